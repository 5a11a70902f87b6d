"""The testbed: real CPU quotas and shaped links, checked with the kernel's own figures, and torn
down however the launcher ends. Needs root, the cgroup cpu controller and iproute2 (this machine's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from subprocess import PIPE

import pytest
import yaml

from tessera.cluster.spec import Cluster
from tessera.errors import TestbedError
from tessera.testbed import Testbed, clean_stale
from tessera.testbed.cpu import PERIOD_US, CpuGroups, Hierarchy, find_cpu_hierarchy
from tessera.testbed.network import check_tools
from tessera.testbed.testbed import ENTER_SCRIPT, STATE_DIR

RATE = 6.25e6  # 50 Mbit/s between the two nodes
CLUSTER = {
    "nodes": [
        {"name": "a", "devices": [{"type": "fast", "count": 1}]},
        {"name": "b", "devices": [{"type": "slow", "count": 1}]},
    ],
    "device_types": {
        "fast": {"peak_tflops": {"fp32": 1.0}, "memory_gib": 8, "bandwidth_gbs": 10},
        "slow": {"peak_tflops": {"fp32": 0.25}, "memory_gib": 8, "bandwidth_gbs": 10},
    },
    "links": {"inter_node": {"bandwidth_gbs": RATE / 1e9, "latency_us": 50}},
}
TESTS = Path(__file__).parent


def _leftovers(name: str) -> list[str]:
    """What a testbed named ``name`` left on the machine."""
    found = [
        f"netns {ns}"
        for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        if ns.startswith(name)
    ]
    found += [f"cgroup {p}" for p in Path(find_cpu_hierarchy().root).glob(f"{name}*")]
    found += [f"state {p}" for p in STATE_DIR.glob(f"{name}*")]
    return found


# ------------------------------------------------------------------ without root: files and errors
def test_cpu_groups_write_v1_and_v2_quotas(tmp_path: Path) -> None:
    for version in (1, 2):
        root = tmp_path / f"v{version}"
        root.mkdir()
        groups = CpuGroups.create("tessera-t", [0.6, 0.15], Hierarchy(root, version))
        if version == 1:
            assert (groups.path(1) / "cpu.cfs_quota_us").read_text() == str(int(0.15 * PERIOD_US))
            assert (groups.path(0) / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
        else:
            assert (groups.path(0) / "cpu.max").read_text() == f"{int(0.6 * PERIOD_US)} {PERIOD_US}"
            assert (groups.parent / "cgroup.subtree_control").read_text() == "+cpu"
        groups.remove()
        assert not groups.parent.exists()


def test_a_share_below_the_kernels_smallest_quota_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TestbedError, match="smallest quota.*--testbed-cpus"):
        CpuGroups.create("tessera-t", [1.0, 0.05], Hierarchy(tmp_path, 1))
    assert not (tmp_path / "tessera-t").exists()


def test_the_cpu_controller_is_found_in_the_mounts(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,cpu,cpuacct 0 0\n")
    assert find_cpu_hierarchy(mounts) == Hierarchy(Path("/sys/fs/cgroup/cpu,cpuacct"), 1)
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cgroup.controllers").write_text("cpuset cpu io memory")
    mounts.write_text(f"cgroup2 {tmp_path / 'v2'} cgroup2 rw 0 0\n")
    assert find_cpu_hierarchy(mounts) == Hierarchy(tmp_path / "v2", 2)
    mounts.write_text("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n")
    with pytest.raises(TestbedError, match="no cgroup cpu controller.*--emulate"):
        find_cpu_hierarchy(mounts)


def test_not_root_or_no_iproute2_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="needs root.*--emulate"):
        Testbed(Cluster.from_dict(CLUSTER), [0, 1]).__enter__()
    monkeypatch.setattr("shutil.which", lambda tool: None)
    with pytest.raises(TestbedError, match="ip and tc"):
        check_tools()


def test_shares_follow_the_devices_speeds_and_bad_seats_are_refused() -> None:
    bed = Testbed(Cluster.from_dict(CLUSTER), [0, 1], cpus=1.25)
    assert bed.cores() == pytest.approx([1.0, 0.25])
    assert bed.link_rates() == {(0, 1): pytest.approx(RATE)}
    with pytest.raises(TestbedError, match="plays cluster device 2.*describes 2 devices"):
        Testbed(Cluster.from_dict(CLUSTER), [0, 2])


# ------------------------------------------------------------------ as root: the real thing
def test_ranks_get_their_quota_and_their_link_rate(tmp_path: Path) -> None:
    """Both upper bounds are the kernel's: a rank cannot get more CPU than its quota, nor send faster
    than its link's token bucket lets it (load on the machine can only lower them)."""
    with Testbed(Cluster.from_dict(CLUSTER), [0, 1], cpus=0.75) as bed:  # 0.6 and 0.15 of a core
        seats = json.loads(bed.seats_file.read_text())["seats"]
        env = {**os.environ, "PYTHONPATH": str(TESTS), "PROBE_PEER": seats[1]["address"]}
        procs = [
            subprocess.Popen(
                [sys.executable, str(ENTER_SCRIPT), str(bed.seats_file), "testbed_probe", "29517"],
                env={**env, "RANK": str(rank)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        results = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert not _leftovers(bed.name)
    for seat, result in zip(seats, results):
        assert f"{seat['cores']:.3g} of a core" in result["verified"] and seat["namespace"] in result["verified"]
        # one period of slack on top of the quota: the CFS accounting granularity
        assert result["cpu_share"] <= seat["cores"] * 1.1 + 0.02, (seat, result)
    assert results[1]["received"] == 2 << 20
    # the bucket lets its depth through at once, the rest at the link's rate
    floor = ((2 << 20) - max(64 * 1024, RATE * 0.004)) / RATE
    assert results[0]["send_s"] >= 0.9 * floor, results[0]


def _hold_a_testbed(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    spec = tmp_path / "cluster.yaml"
    spec.write_text(yaml.safe_dump(CLUSTER))
    # A suite started in the background inherits SIGINT ignored, and Python then keeps it ignored:
    # restore Ctrl-C's handler, or SIGINT never reaches the testbed (the wait below timed out).
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import time; from tessera.cluster.spec import Cluster; from tessera.testbed import Testbed\n"
        f"with Testbed(Cluster.load({str(spec)!r}), [0, 1], cpus=1.0) as bed:\n"
        "    print(bed.name, flush=True); time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_the_testbed_is_torn_down_on_ctrl_c_sigterm_and_by_clean_after_sigkill(tmp_path: Path) -> None:
    held = [_hold_a_testbed(tmp_path) for _ in range(3)]
    for (proc, name), sig in zip(held, (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)):
        assert len(_leftovers(name)) == 4, _leftovers(name)  # two namespaces, the cgroup, the state file
        proc.send_signal(sig)
        proc.wait(30)
    for proc, name in held[:2]:
        assert not _leftovers(name), f"{name} after {proc.returncode}: {_leftovers(name)}"
    killed = held[2][1]
    assert _leftovers(killed), "SIGKILL cannot be caught: its testbed stays until cleaned"
    assert killed in clean_stale() and not _leftovers(killed)


def test_a_job_trains_and_a_profile_measures_on_the_testbed_each_rank_in_its_seat(tmp_path: Path) -> None:
    """`tessera train --testbed` and `tessera cluster profile --testbed`, run side by side (one wait for
    both): every rank confirms its seat with the kernel, and the profile's link is the shaped one."""
    from test_bad_input import GOOD

    from tessera.planner.live.quiet import BUSY_CORES
    from tessera.planner.live.records import LiveProfile

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(CLUSTER))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**GOOD, "logging": {**GOOD["logging"], "out_dir": str(tmp_path / "runs")}}))
    train = ["train", str(config), "--nproc", "2", "--testbed", str(cluster), "--testbed-cpus", "1.6"]
    profile = ["cluster", "profile", str(config), "--cluster", str(cluster), "--testbed", "--testbed-cpus", "1.6"]
    profile += ["--out", str(tmp_path / "live.json"), "--quick"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "tessera.cli", *argv], stdout=PIPE, stderr=PIPE, text=True)
        for argv in (train, profile)
    ]
    (train_out, train_err), (profile_out, profile_err) = (p.communicate(timeout=300) for p in procs)
    out = train_out + train_err
    assert procs[0].returncode == 0 and "over steps 1-2" in train_out, out
    assert "TESTBED: rank 0 plays device 0 (a, fast): 1.28 of a core" in out, out
    assert "TESTBED: rank 1 plays device 1 (b, slow): 0.32 of a core" in out and "namespace tessera-" in out, out
    name = out.split("testbed ", 1)[1].split(":", 1)[0]
    assert not _leftovers(name)

    assert procs[1].returncode == 0, profile_out + profile_err
    assert "TESTBED: rank 1 plays device 1 (b, slow)" in profile_out, profile_out
    live = LiveProfile.load(tmp_path / "live.json")
    assert [(r.rank, r.device, r.node) for r in live.ranks] == [(0, 0, "a"), (1, 1, "b")]
    assert all(r.profile.layers["block"].forward_s and r.optimizer_gbs > 0 for r in live.ranks)
    assert all(min(r.recheck_s) > 0 for r in live.ranks), live.ranks  # the same pass at its start and end
    (link,) = live.links
    assert link.nodes == ("a", "b") and link.latency_us > 0
    # the token bucket's rate bounds what any transfer achieves (a little over for the bucket's depth)
    assert 0 < link.bandwidth_gbs * 1e9 <= 1.2 * RATE, link
    # and the bucket's depth is what one push after idling passes at once (the training run beside it
    # shares the CPUs, so within a factor of two)
    depth = max(64 * 1024, RATE * 0.004)
    assert 0.5 * depth <= link.burst_bytes <= 2 * depth, link
    # no node has two ranks: FSDP was timed across the two nodes, the record the slower member's (b's)
    assert live.fsdp_pair is not None and (live.fsdp_pair.node, live.fsdp_pair.across) == ("b", "a"), live.fsdp_pair
    # the training job beside it is another process's load: recorded in the profile, warned of when over the line
    assert "other_cpu_cores" in json.loads((tmp_path / "live.json").read_text())
    assert (live.other_cpu_cores > BUSY_CORES) == ("other processes used" in profile_err), profile_err


def test_counted_traffic_is_what_the_kernel_sent(tmp_path: Path) -> None:
    """Every collective's bytes (tessera.traffic), added up over both ranks, against the bytes their
    interfaces sent meanwhile (/proc/net/dev), for DDP and ZeRO-3 between two nodes. What the kernel
    sends beyond the count is framing: Ethernet, IP and TCP headers and gloo's message preambles,
    under 128 bytes a packet. A collective left uncounted, or gloo's reduce-scatter counted as half
    the all-reduce it really is (ZeRO-3 then misses a quarter of its bytes), fails it."""
    with Testbed(Cluster.from_dict(CLUSTER), [0, 1], cpus=1.6) as bed:
        env = {**os.environ, "PYTHONPATH": str(TESTS), "PROBE_SEATS": str(bed.seats_file)}
        procs = [
            subprocess.Popen(
                [sys.executable, str(ENTER_SCRIPT), str(bed.seats_file), "traffic_probe", "29533"],
                env={**env, "RANK": str(rank)},
                stdout=PIPE,
                stderr=PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        outputs = [p.communicate(timeout=300) for p in procs]
    assert not _leftovers(bed.name)
    assert all(p.returncode == 0 for p in procs), outputs
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for layout in ("ddp", "zero3"):
        counted = sum(r[layout]["inter_node"] for r in results)
        wire = sum(r[layout]["wire"] for r in results)
        packets = sum(r[layout]["packets"] for r in results)
        assert counted > 1e6 and all(r[layout]["intra_node"] == r[layout]["across_groups"] == 0 for r in results)
        assert 0 <= wire - counted <= 128 * packets + 16_384, (layout, counted, wire, packets)
