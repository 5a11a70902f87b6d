"""Heterogeneous-issue part 1: the cluster description, the device catalogue, and detection.

Acceptance 4 (the cluster-file parts): unknown types with no figures, zero memory, links to
missing nodes and other mistakes get errors naming the node or link and the field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tessera.cli import main
from tessera.cluster import CATALOG, Cluster, ClusterError, lookup
from tessera.cluster.detect import catalog_name, describe, detect

REQUIRED = ("H100", "H200", "A100-40GB", "A100-80GB", "A10", "L4", "T4", "V100", "RTX4090", "RTX3090", "A6000")


def one_node(**device) -> dict:
    return {"nodes": [{"name": "a", "devices": [{"type": "A100-80GB", "count": 2, **device}]}]}


def test_catalogue_covers_the_common_types_with_datasheet_figures() -> None:
    for name in (*REQUIRED, "MI250X", "cpu"):
        t = CATALOG[name]
        assert t.memory_gib > 0 and t.bandwidth_gbs > 0 and t.peak("fp32") > 0, name
    assert CATALOG["H100"].peak("bf16") == 989.0 and CATALOG["A100-80GB"].peak("bf16") == 312.0
    assert CATALOG["T4"].peak("bf16") is None  # no bf16 fast path: a bf16 plan on T4 must be refused
    assert lookup("a100") is CATALOG["A100-80GB"] and lookup("RTX-4090") is CATALOG["RTX4090"]


def test_a_type_name_and_a_count_are_enough() -> None:
    cluster = Cluster.from_dict(one_node())
    assert cluster.world_size == 2
    assert [t.name for _, _, t in cluster.devices()] == ["A100-80GB", "A100-80GB"]
    assert Cluster.from_dict(yaml.safe_load(cluster.to_yaml())) == cluster


def test_links_follow_nodes_and_regions() -> None:
    cluster = Cluster.from_dict(
        {
            "nodes": [
                {"name": "a", "region": "us", "devices": [{"type": "H100", "count": 8}]},
                {"name": "b", "region": "us", "devices": [{"type": "L4", "count": 4}]},
                {"name": "c", "region": "eu", "devices": [{"type": "MyGPU", "count": 2}]},
            ],
            "device_types": {"MyGPU": {"peak_tflops": {"bf16": 200}, "memory_gib": 48, "bandwidth_gbs": 900}},
            "links": {"inter_region": {"bandwidth_gbs": 0.5, "latency_us": 80000}},
        }
    )
    assert cluster.link("a", "a").bandwidth_gbs == 300.0  # intra-node default
    assert cluster.link("a", "b").bandwidth_gbs == 25.0  # same region
    assert cluster.link("a", "c").bandwidth_gbs == 0.5 and cluster.link("c", "b").latency_us == 80000
    assert cluster.device_type("c").peak("bf16") == 200.0
    assert cluster.link("a", "c").seconds(1e9) == pytest.approx(0.08 + 2.0)
    # a shaped link's burst: read, written back, and what it saves a transfer that starts on it idle
    shaped = Cluster.from_dict({**one_node(), "links": {"inter_node": {"bandwidth_gbs": 1, "burst_bytes": 65536}}})
    assert Cluster.from_dict(shaped.to_dict()).links["inter_node"].burst_bytes == 65536
    assert shaped.links["inter_node"].burst_s(1e6) == pytest.approx(65536e-9)
    assert shaped.links["inter_node"].burst_s(1e3) == pytest.approx(1e-6) and "burst" not in str(cluster.to_dict())


def test_file_figures_override_the_catalogue_field_by_field() -> None:
    cluster = Cluster.from_dict({**one_node(), "device_types": {"A100-80GB": {"memory_gib": 70}}})
    t = cluster.device_type("a")
    assert t.memory_gib == 70 and t.peak("bf16") == 312.0  # memory overridden, peaks from the datasheet


@pytest.mark.parametrize(
    "data,needle",
    [
        (one_node(type="B300"), "node 'a'.devices[0].type='B300' is not in the catalogue"),
        (one_node(type="H10"), 'did you mean "H100"'),
        (
            {**one_node(type="X"), "device_types": {"X": {"peak_tflops": {"bf16": 100}, "memory_gib": 0}}},
            "device_types.X.memory_gib must be a positive number, got 0",
        ),
        ({**one_node(type="X"), "device_types": {"X": {"memory_gib": 8}}}, "device_types.X.peak_tflops must map"),
        ({**one_node(type="X"), "device_types": {"X": {"peak_tflops": {"int8": 9}}}}, "unknown dtype 'int8'"),
        (one_node(count=0), "node 'a'.devices[0].count must be a positive integer"),
        (
            {**one_node(), "links": {"between": [{"nodes": ["a", "b"], "bandwidth_gbs": 10}]}},
            "links.between[0] links to node 'b', which the file does not define",
        ),
        ({**one_node(), "links": {"inter_node": {"bandwidth_gbs": -1}}}, "links.inter_node.bandwidth_gbs"),
        (
            {**one_node(), "links": {"inter_node": {"bandwidth_gbs": 1, "burst_bytes": -5}}},
            "links.inter_node.burst_bytes must be a non-negative number",
        ),
        ({**one_node(), "links": {"inter_node": {"bandwidth_gbs": 1, "burst": 5}}}, "unknown field 'burst'"),
        ({"nodes": [one_node()["nodes"][0], one_node()["nodes"][0]]}, "node 'a': the name is used twice"),
        ({"nodes": [{"name": "a", "device": []}]}, "unknown field 'device' (did you mean \"devices\"?)"),
        ({"nodes": []}, "'nodes' must be a non-empty list"),
    ],
)
def test_bad_cluster_files_name_the_node_and_field(data: dict, needle: str) -> None:
    with pytest.raises(ClusterError) as info:
        Cluster.from_dict(data, source="c.yaml")
    assert needle in str(info.value), str(info.value)


def test_a_machine_may_hold_several_device_types(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Issue 33, item 8: one machine with two kinds of GPU is one file entry. Each type is a node of its own
    (``c/L4``) on that machine: they talk over the intra-node link, a link named for the machine applies to
    them, the file reads back the same, and ``tessera plan`` launches the machine as one torchrun node."""
    data = {
        "nodes": [
            {"name": "a", "devices": [{"type": "A100-80GB", "count": 2}]},
            {"name": "c", "devices": [{"type": "A100-80GB", "count": 1}, {"type": "L4", "count": 1}]},
        ],
        "links": {"between": [{"nodes": ["a", "c"], "gbit_s": 8, "latency_us": 100}]},
    }
    cluster = Cluster.from_dict(data)
    expected = [("a", "a", 2), ("c/A100-80GB", "c", 1), ("c/L4", "c", 1)]
    assert [(n.name, n.host, n.count) for n in cluster.nodes] == expected
    assert [t.name for _, _, t in cluster.devices()] == ["A100-80GB"] * 3 + ["L4"]
    assert cluster.link("c/A100-80GB", "c/L4") == cluster.links["intra_node"]
    assert cluster.worst_link({"c/A100-80GB", "c/L4"}) == cluster.links["intra_node"]
    assert cluster.link("a", "c/L4").bandwidth_gbs == 1.0 == cluster.worst_link({"a", "c/L4"}).bandwidth_gbs
    assert Cluster.from_dict(cluster.to_dict()) == cluster and len(cluster.to_dict()["nodes"]) == 2
    for devices, needle in (
        ([{"type": "L4", "count": 1}, {"type": "L4", "count": 2}], "lists type 'L4' twice"),
        ([{"type": "L4", "count": 1}, {"type": "L4"}], r"devices\[1\] has no count"),
        ([], "must be a list of {type, count} entries"),
    ):
        with pytest.raises(ClusterError, match=needle):
            Cluster.from_dict({"nodes": [{"name": "m", "devices": devices}]})
    from tessera.plan import Plan
    from tessera.planner.command import print_launch

    print_launch(Plan(dp=4), cluster, str(tmp_path / "p.yaml"))  # every device: machine a, then machine c
    launch = [line.strip() for line in capsys.readouterr().out.splitlines() if "tessera train" in line]
    common = f"tessera train CONFIG --set plan.file={tmp_path / 'p.yaml'} --nproc 2 --nnodes 2"
    assert launch == [f"a: {common} --node-rank 0 --rdzv-endpoint a:29400",
                      f"c: {common} --node-rank 1 --rdzv-endpoint a:29400"], launch  # fmt: skip


def test_detect_describes_this_machine_as_a_valid_file(tmp_path: Path) -> None:
    text = describe(detect("here"))
    assert "measured here" in text  # measured figures are labelled as such
    cluster = Cluster.from_dict(yaml.safe_load(text))
    (node,) = cluster.nodes
    assert node.name == "here" and node.count >= 1
    assert cluster.device_type("here").memory_gib > 0 and cluster.device_type("here").peak("fp32") > 0


def test_gpu_names_map_to_the_catalogue() -> None:
    assert catalog_name("NVIDIA A100-SXM4-40GB", 39.4) == "A100-40GB"
    assert catalog_name("NVIDIA A100-SXM4-80GB", 79.2) == "A100-80GB"
    assert catalog_name("NVIDIA A10", 22.1) == "A10"
    assert catalog_name("NVIDIA H200", 139.8) == "H200"
    assert catalog_name("NVIDIA GeForce RTX 4090", 23.6) == "RTX4090"
    assert catalog_name("NVIDIA RTX A6000", 47.5) == "A6000"
    assert catalog_name("Some Future GPU", 99.0) is None


def test_cli_check_and_detect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.yaml"
    assert main(["cluster", "detect", "--name", "box", "--out", str(out)]) == 0
    assert main(["cluster", "check", str(out)]) == 0
    assert "# valid: " in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - name: a\n    devices: [{type: A100-80GB, count: 0}]\n")
    assert main(["cluster", "check", str(bad)]) == 2
    assert "count must be a positive integer" in capsys.readouterr().err


def test_a_device_entry_needs_its_count_and_a_link_says_its_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33, item 4: a missing count was taken as one device; bandwidth_gbs (GB/s) was a unit learnt from
    the source. gbit_s is Gbit/s, bandwidth_gbs a deprecated alias (8x smaller); both at once is refused;
    `tessera cluster check` prints every node, device and link with units."""
    with pytest.raises(ClusterError, match=r"node 'a'.devices\[0\] has no count: write count: N"):
        Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "H100"}]}]})
    nodes = [
        {"name": "a", "devices": [{"type": "H100", "count": 2}]},
        {"name": "b", "devices": [{"type": "L4", "count": 1}]},
    ]
    in_bits = Cluster.from_dict({"nodes": nodes, "links": {"inter_node": {"gbit_s": 100, "latency_us": 10},
                                 "between": [{"nodes": ["a", "b"], "gbit_s": 1, "latency_us": 500}]}})  # fmt: skip
    with pytest.warns(FutureWarning, match="bandwidth_gbs .* is deprecated: write gbit_s"):
        old = {"inter_node": {"bandwidth_gbs": 12.5, "latency_us": 10},
               "between": [{"nodes": ["a", "b"], "bandwidth_gbs": 0.125, "latency_us": 500}]}  # fmt: skip
        in_bytes = Cluster.from_dict({"nodes": nodes, "links": old})
    assert in_bits.links == in_bytes.links and in_bits.pair_links == in_bytes.pair_links
    assert in_bits.links["inter_node"].bandwidth_gbs == 12.5  # bytes inside: 100 Gbit/s moves 12.5 GB a second
    assert Cluster.from_dict(in_bits.to_dict()).pair_links == in_bits.pair_links  # written back in gbit_s
    with pytest.raises(ClusterError, match="gives both gbit_s and bandwidth_gbs"):
        Cluster.from_dict({"nodes": nodes, "links": {"inter_node": {"gbit_s": 100, "bandwidth_gbs": 12.5}}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(in_bits.to_dict()))
    assert main(["cluster", "check", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "node a (default): 2 x H100" in printed, printed
    assert "link inter_node: 100 Gbit/s (12.5 GB/s), latency 10 us" in printed
    assert "link a - b: 1 Gbit/s (0.125 GB/s), latency 500 us" in printed
