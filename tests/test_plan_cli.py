"""`tessera plan --model --cluster --global-batch`: a table, a Plan file, a picture; clear errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tessera.cli import main
from tessera.plan import Plan

CLUSTER = """\
nodes:
  - {name: a, devices: [{type: A100-80GB, count: 2}]}
  - {name: b, devices: [{type: T4, count: 2}]}
"""


def _run(tmp_path: Path, capsys, cluster: str, *extra: str) -> tuple[int, str, str]:
    (tmp_path / "cluster.yaml").write_text(cluster)
    demo = Path(__file__).parents[1] / "examples" / "demo.yaml"
    code = main(
        ["plan", "--model", str(demo), "--cluster", str(tmp_path / "cluster.yaml"),
         "--out", str(tmp_path / "plan.yaml"), "--png", str(tmp_path / "plan.png"), *extra]
    )  # fmt: skip
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_table_writes_plan_and_picture(tmp_path: Path, capsys) -> None:
    code, out, _ = _run(tmp_path, capsys, CLUSTER, "--global-batch", "16", "--top", "3")
    assert code == 0
    assert "best plans for Llama" in out and "tokens/s" in out and "bottleneck" not in out.splitlines()[0]
    assert len([line for line in out.splitlines() if line.startswith(" ") and line[:3].strip().isdigit()]) == 3
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.resolve(4).dp * plan.tp * plan.pp == 4
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    # The file says how many ranks to launch (issue 33, item 8): first, read by `plan check` and the launcher.
    assert (tmp_path / "plan.yaml").read_text().startswith("world_size: 4\n")
    assert (
        main(["plan", "check", str(tmp_path / "plan.yaml")]) == 0 and "# valid for 4 ranks" in capsys.readouterr().out
    )
    from tessera.config import ConfigError
    from tessera.launch.preflight import check_training

    config = yaml.safe_load((Path(__file__).parents[1] / "examples" / "demo.yaml").read_text())
    config["plan"] = {"file": str(tmp_path / "plan.yaml")}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"was made for 4 ranks \(its world_size\), but this launch starts 2"):
        check_training(str(tmp_path / "c.yaml"), [], 2, 1, False)


def test_plan_refuses_a_global_batch_smaller_than_the_data_parallel_ranks(tmp_path: Path, capsys) -> None:
    five = CLUSTER.replace("A100-80GB, count: 2", "A100-80GB, count: 3")  # 5 devices: only dp=5 fits 4 layers
    code, _, err = _run(tmp_path, capsys, five, "--global-batch", "1")
    assert code == 2
    assert "tessera: error: global_batch_size=1 is smaller than the number of data-parallel ranks" in err


def test_launch_instructions_for_many_nodes_go_to_a_file(tmp_path: Path, capsys) -> None:
    """Six nodes: the console gets a one-line summary, the file one command per machine."""
    six = "nodes:\n" + "".join(f"  - {{name: n{i}, devices: [{{type: A100-80GB, count: 2}}]}}\n" for i in range(6))
    code, out, err = _run(tmp_path, capsys, six, "--global-batch", "24", "--top", "1")
    assert code == 0, err
    lines = (tmp_path / "plan.launch.txt").read_text().splitlines()
    assert len(lines) == 6 and all("--nnodes 6" in line and "--nproc 2 " in line for line in lines), lines
    assert sorted(int(line.split("--node-rank ")[1].split()[0]) for line in lines) == list(range(6))
    summary = [line for line in out.splitlines() if line.startswith("launch plan 0")]
    assert len(summary) == 1 and "one command per machine in" in summary[0], summary
    assert not any(f"n{i} " in summary[0] for i in (1, 2, 3, 4)), summary  # a summary, not the list
    # what a scheduler takes: the machines in --node-rank order, and a script each machine runs as it is
    hosts = (tmp_path / "plan.hosts").read_text().split()
    assert hosts == [line.split(":")[0] for line in lines] and sorted(hosts) == [f"n{i}" for i in range(6)]
    env = {**os.environ, "PATH": f"{_stub(tmp_path)}:{os.environ['PATH']}"}
    script = str(tmp_path / "plan.launch.sh")
    for line in lines:
        machine, command = line.split(": ", 1)
        ran = subprocess.run(["bash", script, machine], capture_output=True, text=True, env=env, timeout=30)
        assert ran.returncode == 0 and ran.stdout.strip() == command, (ran.stdout, ran.stderr, command)
    ran = subprocess.run(["bash", script, "elsewhere"], capture_output=True, text=True, env=env, timeout=30)
    assert ran.returncode == 2 and "elsewhere is not one of the plan's machines (plan.hosts)" in ran.stderr


def _stub(tmp_path: Path) -> Path:
    """A folder holding a `tessera` that prints what it was given (stands in for tessera in launch scripts)."""
    stub = tmp_path / "bin" / "tessera"
    if not stub.exists():
        stub.parent.mkdir()
        stub.write_text('#!/usr/bin/env bash\necho "tessera $*"\n')
        stub.chmod(0o755)
    return stub.parent


def test_regions_made_differently_plan_a_job_per_group(tmp_path: Path, capsys) -> None:
    """Two regions of different devices over a slow link: plan 0 is a fault-tolerant group per region, each laid
    out its own way; the table shows each group's layout and the launch is a Lighthouse and a job per group."""
    regions = """\
nodes:
  - {name: a, region: east, devices: [{type: A100-80GB, count: 2}]}
  - {name: b, region: west, devices: [{type: A10, count: 2}]}
  - {name: c, region: west, devices: [{type: A10, count: 1}]}
links:
  inter_region: {bandwidth_gbs: 0.05, latency_us: 50000}
"""
    code, out, err = _run(tmp_path, capsys, regions, "--global-batch", "32", "--top", "2")
    assert code == 0, err
    assert "each laid out its own way" in out and "group 0: 2 ranks" in out and "group 1: 3 ranks" in out, out
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.groups is not None and plan.groups.fault_tolerant and plan.groups.layouts is not None
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    # Complete commands (issue 35, item 0), parsed back and checked as the launcher checks them: the Lighthouse
    # on group 0's machine, then each group's job with its group, the Lighthouse's address, its own rendezvous,
    # and each machine its block of the group's ranks (group 1: machine b's two, then c's one).
    import shlex

    from tessera.arguments import build_parser
    from tessera.launch.node_rank import FIRST_RANK_ENV, node_blocks
    from tessera.launch.preflight import check_training

    commands = [line.strip().split(": ", 1) for line in out.splitlines() if line[:2] == "  " and ": tessera " in line]
    assert commands[0] == ["a", "tessera lighthouse --bind a:29510"], commands
    assert build_parser().parse_args(shlex.split(commands[0][1])[1:]).bind == "a:29510"
    expected = {}  # each machine's (group, ranks, machines in its group, --node-rank, rendezvous, first rank)
    for g in range(2):
        blocks = node_blocks(plan.group_plan(g))
        for k, (machine, ranks) in enumerate(blocks):
            expected[machine] = (g, ranks, len(blocks), k, blocks[0][0], sum(n for _, n in blocks[:k]))
    assert sorted(expected) == ["a", "b", "c"] and expected["a"][:3] == (0, 2, 1), expected
    for host, command in commands[1:]:
        args = build_parser().parse_args(shlex.split(command)[1:])
        group, nproc, nnodes, node_rank, rendezvous, first = expected[host]
        assert (args.group, args.lighthouse, args.nproc) == (group, "http://a:29510", nproc), command
        assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == (nnodes, node_rank, f"{rendezvous}:29400"), command
        assert args.overrides == [f"plan.file={tmp_path / 'plan.yaml'}", "train.global_batch_size=32"]  # planned
        checked = check_training(args.config, args.overrides, args.nproc, args.nnodes, False, args.group,
                                 args.node_rank)  # fmt: skip
        assert checked.env[FIRST_RANK_ENV] == str(first), (host, checked.env)
        mine = plan.group_plan(group).rank_devices[first : first + nproc]
        assert {label.split(":")[0] for label in mine} == {host}, (host, mine)
        checked.close()
    assert sorted(host for host, _ in commands[1:]) == ["a", "b", "c"], commands


def test_fault_tolerant_groups_on_many_machines_get_a_script_and_host_file_per_group(tmp_path: Path, capsys) -> None:
    """Issue 35, item 5: six machines in two regions, a job per region: per group a command file, a host file
    and a script each machine runs as it is; the console a summary line per group."""
    from tessera.cluster import Cluster
    from tessera.plan import Groups
    from tessera.planner.command import print_launch

    nodes = [{"name": f"e{i}", "region": "east", "devices": [{"type": "A100-80GB", "count": 2}]} for i in range(4)]
    nodes += [{"name": f"w{i}", "region": "west", "devices": [{"type": "A10", "count": 1}]} for i in range(2)]
    groups = Groups(count=2, fault_tolerant=True, sizes=(8, 2), layouts=({}, {}), shares=(4, 1))
    print_launch(Plan(groups=groups), Cluster.from_dict({"nodes": nodes}), str(tmp_path / "plan.yaml"), "run.yaml")
    out = capsys.readouterr().out
    assert "e0: tessera lighthouse --bind e0:29510" in out and len(out.splitlines()) == 5, out
    for g, (machines, nproc) in enumerate(((["e0", "e1", "e2", "e3"], 2), (["w0", "w1"], 1))):
        lines = (tmp_path / f"plan.group{g}.launch.txt").read_text().splitlines()
        assert (tmp_path / f"plan.group{g}.hosts").read_text().split() == machines
        for k, line in enumerate(lines):
            host, command = line.split(": ", 1)
            assert host == machines[k] and f"--group {g} --lighthouse http://e0:29510" in command, line
            assert f"--nproc {nproc} --nnodes {len(machines)} --node-rank {k} --rdzv-endpoint {machines[0]}:29400" in (
                command
            ), line
            ran = subprocess.run(["bash", str(tmp_path / f"plan.group{g}.launch.sh"), host], capture_output=True,
                                 text=True, env={**os.environ, "PATH": f"{_stub(tmp_path)}:{os.environ['PATH']}"},
                                 timeout=30)  # fmt: skip
            assert ran.returncode == 0 and ran.stdout.strip() == command, (ran.stdout, ran.stderr)
        assert f"group {g}: {len(machines)} machines" in out, out


def test_launch_lines_are_commands_that_launch_each_machine_s_ranks_of_the_plan(tmp_path: Path, capsys) -> None:
    """Issue 35, item 0: each printed line is a whole `tessera train` command (config, plan file, --nproc,
    --nnodes, --node-rank, --rdzv-endpoint). Parsed back by tessera's own parser and checked as the launcher
    checks it, each machine's ranks get that machine's block of the plan's ranks, machines of different sizes
    too; a machine launched with the wrong --nproc is told the right one."""
    import shlex

    from tessera.arguments import build_parser
    from tessera.config import ConfigError
    from tessera.launch.node_rank import FIRST_RANK_ENV, NODE_RANK_ENV
    from tessera.launch.preflight import check_training

    three = CLUSTER.replace("{type: T4, count: 2}", "{type: A100-80GB, count: 1}")
    code, out, err = _run(tmp_path, capsys, three, "--global-batch", "16", "--top", "1")
    assert code == 0, err
    lines = [line.split(": ", 1) for line in out.splitlines() if line.startswith("  ") and "tessera train" in line]
    assert [host.strip() for host, _ in lines] == ["a", "b"], out
    plan = Plan.load(tmp_path / "plan.yaml")
    for k, (host, command) in enumerate(lines):
        argv = shlex.split(command)
        assert argv[0] == "tessera"
        args = build_parser().parse_args(argv[1:])
        assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == (2, k, "a:29400")
        assert args.overrides == [f"plan.file={tmp_path / 'plan.yaml'}"]  # planned for the config's batch
        checked = check_training(args.config, args.overrides, args.nproc, args.nnodes, False, None, args.node_rank)
        first = int(checked.env[FIRST_RANK_ENV])
        assert checked.env[NODE_RANK_ENV] == str(k)
        mine = plan.rank_devices[first : first + args.nproc]
        assert {label.split(":")[0] for label in mine} == {host.strip()}, (host, mine)  # that machine's devices
        checked.close()
    assert (int(shlex.split(lines[0][1])[shlex.split(lines[0][1]).index("--nproc") + 1]), args.nproc) == (2, 1)
    with pytest.raises(ConfigError, match="'a', which runs 2 ranks, but --nproc is 1: launch it with --nproc 2"):
        check_training(args.config, args.overrides, 1, 2, False, None, 0)


def test_the_table_never_lists_a_plan_twice(tmp_path: Path, capsys) -> None:
    """Issue 35, item 5: two alike nodes can trade stages; the two plans are one row to a reader (same layout,
    same predicted step), so the table shows it once."""
    two = "nodes:\n" + "".join(f"  - {{name: n{i}, devices: [{{type: A100-80GB, count: 2}}]}}\n" for i in range(2))
    code, out, err = _run(tmp_path, capsys, two, "--global-batch", "16", "--top", "10")
    assert code == 0, err
    lines = out.splitlines()
    rows = [
        line[3:] + (lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("    ") else "")
        for i, line in enumerate(lines)
        if line[:3].strip().isdigit()
    ]
    assert len(rows) > 2 and len(set(rows)) == len(rows), "\n".join(rows)


def test_the_picture_of_a_4096_device_plan_draws_a_bar_per_region_and_node_kind() -> None:
    """Issue 35, item 5: 512 nodes in three regions drew 4,096 labelled squares (512 overlapping node labels).
    Past 32 nodes the device panel has one bar per region and node kind, split by stage with device counts
    that add up to the job; the table summarises long share tuples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tessera.cluster import Cluster
    from tessera.planner.draw import _devices

    kinds = (("us", "A100-80GB", 256), ("eu", "H100", 128), ("ap", "L4", 128))
    cluster = Cluster.from_dict({"nodes": [
        {"name": f"{region}{i}", "region": region, "devices": [{"type": name, "count": 8}]}
        for region, name, nodes in kinds for i in range(nodes)
    ]})  # fmt: skip
    assert cluster.world_size == 4096
    fig, ax = plt.subplots()
    _devices(ax, Plan(dp=128, tp=8, pp=4, pipeline={"microbatches": 4}), cluster, plt.get_cmap("tab20"))
    labels = [t.get_text() for t in ax.texts]
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    plt.close(fig)
    assert len(ticks) == 3 and ticks[0] == "us: 256 x A100-80GB x8 (128 replicas)", ticks
    assert len(labels) <= 3 * 5, labels  # at most every stage and "out" in each bar
    assert sum(int(label.split(": ")[1]) for label in labels) == 4096, labels
    assert labels[:2] == ["s0: 1024", "s1: 1024"], labels  # rank order fills the A100 nodes first
    from tessera.planner.command import summary

    assert summary((4,) * 256 + (3,) * 200 + (5,) * 56) == "512 ranks, 3..5 samples: 256x 4, 200x 3, 56x 5"
    assert summary((6, 5, 5)) == "(6, 5, 5)"  # short ones whole
