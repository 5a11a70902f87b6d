"""The live profile (issue 13 item 2): what ranks measure becomes the cluster and costs the planner reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity import build_model

from tessera.cluster.spec import Cluster
from tessera.errors import PlanError
from tessera.planner import ModelCosts, plan_for
from tessera.planner.live.inputs import measured_cluster, measured_costs, relative_speeds
from tessera.planner.live.measure import burst_from_push
from tessera.planner.live.records import LinkMeasurement, LiveProfile, RankMeasurement
from tessera.planner.profile import Profile, profile_model

CLUSTER = {
    "nodes": [
        {"name": "a", "devices": [{"type": "fast", "count": 2}]},
        {"name": "b", "devices": [{"type": "slow", "count": 1}]},
    ],
    "device_types": {
        "fast": {"peak_tflops": {"fp32": 1.0}, "memory_gib": 8, "bandwidth_gbs": 10},
        "slow": {"peak_tflops": {"fp32": 0.25}, "memory_gib": 4, "bandwidth_gbs": 10},
    },
    "links": {"inter_node": {"bandwidth_gbs": 0.00625, "latency_us": 50}},
}


def _scaled(profile: Profile, factor: float) -> Profile:
    """``profile`` with fixed times (a call of 1 ms plus 0.5 ms per sample forward, twice that backward),
    times ``factor``: the measured structure, deterministic numbers."""
    data = json.loads(profile.to_json())
    for part in data["layers"].values():
        part["forward_s"] = {b: (1e-3 + 5e-4 * int(b)) * factor for b in part["forward_s"]}
        part["backward_s"] = {b: 2 * (1e-3 + 5e-4 * int(b)) * factor for b in part["backward_s"]}
    return Profile.from_json(json.dumps(data))


@pytest.fixture(scope="module")
def live() -> LiveProfile:
    """Three ranks: two on node a, one on node b three times slower (as a device measured that way would be)."""
    base = profile_model(build_model("llama:4"), batch_sizes=(1, 2), seq_len=16, repeats=1)
    ranks = [
        RankMeasurement(0, 0, "a", "fast", _scaled(base, 1.0), 8.0, 1 << 30, "process max RSS"),
        RankMeasurement(1, 1, "a", "fast", _scaled(base, 1.1), 6.0, 1 << 30, "process max RSS"),
        RankMeasurement(2, 2, "b", "slow", _scaled(base, 3.0), 2.0, 1 << 30, "process max RSS"),
    ]
    links = [
        LinkMeasurement(("a", "b"), (0, 2), 0.004, 300.0),
        LinkMeasurement(("a", "a"), (0, 1), 1.5, 20.0),
    ]
    return LiveProfile(base.model_key, 16, "fp32", "a test", ranks, links, 80.0, 0.003)


def test_the_measured_cluster_carries_measured_speeds_memory_speeds_and_links(live: LiveProfile) -> None:
    from dataclasses import replace

    cluster = measured_cluster(Cluster.from_dict(CLUSTER), live)
    speeds = relative_speeds(live)
    # against node a's median block time (1.05: its ranks take 1 and 1.1), not its faster rank's
    assert speeds["b"] == pytest.approx(1.05 / 3) and speeds["a"] == 1.0
    slow = cluster.device_type("b")
    assert slow.name == "b (measured)" and slow.peak("fp32") == pytest.approx(1.05 / 3)
    assert slow.memory_gib == 4 and slow.bandwidth_gbs == 2.0  # capacity declared, speed measured
    assert slow.host_bandwidth_gbs == 2.0  # a CPU rank is its own host: offloading to it gains nothing
    assert cluster.device_type("a").bandwidth_gbs == pytest.approx(7.0)  # median optimizer speed of a's ranks
    # between nodes: the pair's send bandwidth, latency and burst; neither the pair's all-reduce nor the
    # world's bounds it (rings of four crossed the testbed's slow pair at its send rate)
    assert cluster.link("a", "b").bandwidth_gbs == 0.004 and cluster.link("a", "b").latency_us == 300.0
    assert cluster.link("a", "a").bandwidth_gbs == 1.5
    timed = [
        replace(live.links[0], bandwidth_gbs=0.05, all_reduce_gbs=0.02, burst_bytes=65536.0),
        replace(live.links[1], all_reduce_gbs=0.9, burst_bytes=1e6),  # inside a node: a quota's artefact
    ]
    paired = measured_cluster(Cluster.from_dict(CLUSTER), replace(live, links=timed))
    assert paired.link("a", "b").bandwidth_gbs == 0.05 and paired.link("a", "a").bandwidth_gbs == 1.5
    assert paired.link("a", "b").burst_bytes == 65536.0 and cluster.link("a", "b").burst_bytes == 0.0
    assert paired.link("a", "a").burst_bytes == 0.0
    overlapping = [replace(r, comm_overlap=share) for r, share in zip(live.ranks, (0.2, 0.4, 1.0))]
    measured = measured_cluster(Cluster.from_dict(CLUSTER), replace(live, ranks=overlapping))
    assert measured.device_type("a").comm_overlap == pytest.approx(0.3)  # the median of its ranks'
    assert measured.device_type("b").comm_overlap == 1.0
    on_gloo = measured_cluster(Cluster.from_dict(CLUSTER), replace(live, backend="gloo"))
    assert {on_gloo.link("a", "b").backend, on_gloo.link("a", "a").backend} == {"gloo"}
    assert cluster.link("a", "b").backend == "nccl"  # what the fixture's profile says it ran


def test_a_links_burst_is_what_one_push_after_idling_gained_over_its_bandwidth() -> None:
    """50 Mbit/s, 100 µs one way, a 64 KiB bucket: a 312.5 kB push and its acknowledgement take two latencies
    and the rest of the bytes at the rate. A link without a bucket (or a slower push) has none."""
    rate, latency, size = 6.25e6, 1e-4, 312_500
    took = 2 * latency + (size - 65536) / rate
    assert burst_from_push(size, took, rate / 1e9, latency) == pytest.approx(65536)
    assert burst_from_push(size, 2 * latency + size / rate, rate / 1e9, latency) == pytest.approx(0, abs=1e-6)
    assert burst_from_push(size, 1.2 * (2 * latency + size / rate), rate / 1e9, latency) == 0.0
    assert burst_from_push(size, 0.0, rate / 1e9, latency) == size  # at most the push


def test_measured_costs_are_the_fastest_nodes_median_profile_with_the_models_shape(live: LiveProfile) -> None:
    model = build_model("llama:4")
    analytic = ModelCosts.from_model(model, 16)
    costs = measured_costs(live, analytic)
    block = live.ranks[0].profile.layers["block"]  # node a's ranks: this, and 1.1 times it
    # the fitted line passes both points
    assert costs.forward_s("block", 2, 1.0) == pytest.approx(1.05 * block.forward_s[2])
    assert costs.parts["block"].call_s == pytest.approx(1.05e-3) and costs.backward_ratio == pytest.approx(2.0)
    assert costs.heads == analytic.heads and costs.shared_params == analytic.shared_params
    assert "live profile" in costs.source and "node a, median of its 2 rank(s)" in costs.source
    with pytest.raises(PlanError, match="sequence length 16.*planned at 32"):
        measured_costs(live, ModelCosts.from_model(model, 32))


def test_the_planner_times_each_device_at_its_measured_speed(live: LiveProfile) -> None:
    """Through a Plan's layout: the slow node's blocks take its measured 3x (not its declared 4x), node a's
    second device its node's median, and the planner's search runs on the measured cluster."""
    from tessera.plan import Plan
    from tessera.planner.layout import layout_from_plan, op_times

    model = build_model("llama:4")
    cluster = measured_cluster(Cluster.from_dict(CLUSTER), live)
    costs = measured_costs(live, ModelCosts.from_model(model, 16))
    layout = layout_from_plan(Plan(dp_shares=(1, 1, 1)), cluster, costs, 6)
    peaks = sorted({unit.peak_tflops for replica in layout.replicas for unit in replica.units})
    assert peaks == pytest.approx([1.05 / 3, 1.0])
    forward = {replica.units[0].peak_tflops: op_times(layout, costs, replica).forward[0] for replica in layout.replicas}
    assert forward[peaks[0]] / forward[peaks[1]] == pytest.approx(3 / 1.05)  # same micro-batch (even shares)
    best = plan_for(cluster, model, 6, costs=costs, top=1, use_every_device=True)[0]
    assert best.plan.placement is None or sorted(best.plan.placement) == [0, 1, 2]


def test_a_profile_of_another_cluster_or_a_bad_file_is_refused(live: LiveProfile, tmp_path: Path) -> None:
    other = {**CLUSTER, "nodes": [{"name": "a", "devices": [{"type": "fast", "count": 3}]}]}
    with pytest.raises(PlanError, match="node 'b'.*profile again"):
        measured_cluster(Cluster.from_dict(other), live)
    bigger = {**CLUSTER, "nodes": [*CLUSTER["nodes"], {"name": "c", "devices": [{"type": "slow", "count": 1}]}]}
    with pytest.raises(PlanError, match="no device of node\\(s\\) c"):
        measured_cluster(Cluster.from_dict(bigger), live)
    path = live.save(tmp_path / "live.json")
    again = LiveProfile.load(path)
    assert again.ranks[2].profile.layers["block"].forward_s == live.ranks[2].profile.layers["block"].forward_s
    assert again.links[0].nodes == ("a", "b")
    (tmp_path / "bad.json").write_text('{"ranks": 3}')
    with pytest.raises(PlanError, match="not a live profile.*tessera cluster profile"):
        LiveProfile.load(tmp_path / "bad.json")


def test_a_slow_device_that_costs_more_than_it_gives_is_left_out(live: LiveProfile) -> None:
    """Node b computes at a third of a's speed and hangs off a 3 MB/s link: every gradient all-reduce
    with it in costs more than its samples save, so the best plan runs on node a alone, and says so."""
    from tessera.planner.costmodel import estimate
    from tessera.planner.layout import layout_from_plan

    model = build_model("llama:4")
    cluster = measured_cluster(Cluster.from_dict(CLUSTER), live)
    costs = measured_costs(live, ModelCosts.from_model(model, 16))
    best = plan_for(cluster, model, 8, costs=costs, top=3)[0]
    assert best.plan.placement is not None and sorted(best.plan.placement) == [0, 1], best.plan
    assert any("uses 2 of 3 devices, leaving out b:0" in n for n in best.notes), best.notes
    again = estimate(layout_from_plan(best.plan, cluster, costs, 8), costs).step_s  # the plan, on the full cluster
    assert again == pytest.approx(best.estimate.step_s, rel=1e-9)
    everyone = plan_for(cluster, model, 8, costs=costs, top=1, use_every_device=True)[0]
    assert everyone.plan.placement is None or sorted(everyone.plan.placement) == [0, 1, 2]
    assert everyone.estimate.step_s > best.estimate.step_s


def test_what_the_wrappers_add_is_costed_per_unit_and_per_block(live: LiveProfile) -> None:
    """The fastest rank's measured FSDP overhead reaches the costs; the cost model adds it per unit
    (blocks and root) under ZeRO-2/3, and tensor parallelism's per block (at the micro-batch size,
    between the measured ones), scaled by speed, and the simulator charges the same passes."""
    from dataclasses import replace

    from tessera.plan import Plan
    from tessera.planner.layout import layout_from_plan, op_times
    from tessera.planner.simulate import simulate

    ranks = [replace(r, fsdp_unit_s=1e-3 * (1 + i)) for i, r in enumerate(live.ranks)]
    costs = measured_costs(replace(live, ranks=ranks), ModelCosts.from_model(build_model("llama:4"), 16))
    assert costs.fsdp_unit_s == pytest.approx(1.5e-3)  # the median of the fastest node's (1 and 2 ms)
    costs = replace(costs, tp_block_s=3e-3, tp_sample_s=5e-4)  # at micro-batch 4: 5 ms per block and pass
    bare = replace(costs, fsdp_unit_s=0.0, tp_block_s=0.0, tp_sample_s=0.0)
    one_node = Cluster.from_dict({"nodes": [CLUSTER["nodes"][0]], "device_types": CLUSTER["device_types"]})
    cluster = measured_cluster(one_node, replace(live, ranks=ranks[:2], links=live.links[1:]))
    # global batch 4: one replica of micro-batch 4 under tp2, two of 2 under ZeRO
    for plan, extra in ((Plan(zero=3), 5 * 1.5e-3), (Plan(tp=2), 4 * 5e-3), (Plan(zero=0), 0.0)):
        layout = layout_from_plan(plan, cluster, costs, 4)
        unit = layout.replicas[0].units[0]
        scale = costs.ref_tflops / unit.peak_tflops
        with_it, without = op_times(layout, costs, layout.replicas[0]), op_times(layout, bare, layout.replicas[0])
        assert with_it.forward[0] - without.forward[0] == pytest.approx(extra * scale)  # 4 blocks (+ the root)
        assert with_it.backward[0] - without.backward[0] == pytest.approx(extra * scale)
        gained = simulate(layout, costs).step_s - simulate(layout, bare).step_s
        assert gained == pytest.approx(2 * extra * scale, rel=0.05, abs=1e-9)


def test_tensor_parallel_overhead_is_what_the_pair_measured_beyond_compute_share_and_link(live: LiveProfile) -> None:
    """A tp pair on node a whose sharded step is half the plain one, plus the link's all-reduces,
    plus a known extra per block and pass at each size: the derivation recovers the extras, at the
    fastest node's speed, and the costs hold the line through them."""
    from dataclasses import replace

    from tessera.cluster.spec import Link
    from tessera.planner.live.inputs import tensor_parallel_overhead
    from tessera.planner.live.records import TensorParallelMeasurement

    analytic = ModelCosts.from_model(build_model("llama:4"), 16)
    costs = measured_costs(live, analytic)
    own = next(k for k in live.links if k.nodes == ("a", "a"))
    link, blocks = Link(own.bandwidth_gbs, own.latency_us), costs.n_layers
    plain, extra = {2: 0.040, 8: 0.100, 32: 0.300}, {2: 2e-3, 8: 5e-3, 32: 6e-3}
    sharded = {
        b: t / 2 + 4 * blocks * link.all_reduce_s(costs.boundary_bytes(b), 2) + 2 * blocks * extra[b]
        for b, t in plain.items()
    }
    measured = replace(live, tensor_parallel=TensorParallelMeasurement("a", (0, 1), plain, sharded))
    speed_a = relative_speeds(live)["a"]  # the median of a's two ranks: a little under the fastest's
    points = tensor_parallel_overhead(measured, costs)
    assert [b for b, _ in points] == [2, 8, 32]
    assert [t for _, t in points] == pytest.approx([extra[b] * speed_a for b in (2, 8, 32)], rel=1e-6)
    read = measured_costs(measured, analytic)  # the least-squares line through the three points
    slope = sum((b - 14) * (extra[b] - 13e-3 / 3) for b in extra) / sum((b - 14) ** 2 for b in extra)
    assert read.tp_sample_s == pytest.approx(slope * speed_a)
    assert read.tp_block_at(14) == pytest.approx(13e-3 / 3 * speed_a)  # through the means
    assert tensor_parallel_overhead(live, costs) == ()  # nothing measured, nothing added
    assert costs.tp_block_at(8) == 0.0


def test_fsdp_overhead_is_what_a_real_pair_measured_beyond_its_gathers_and_reduce_scatters(live: LiveProfile) -> None:
    """A pair on node a whose sharded step is the plain one, plus its collectives priced by a's link
    (a gather per unit in each pass and gloo's whole-buffer reduce-scatter), plus a known extra per
    unit and pass: the costs hold the extra at the fastest node's speed, not the one-rank figure."""
    from dataclasses import replace

    from tessera.cluster.spec import Link
    from tessera.planner.live.inputs import fsdp_unit_overhead
    from tessera.planner.live.records import FsdpPairMeasurement

    analytic = ModelCosts.from_model(build_model("llama:4"), 16)
    gloo = replace(live, backend="gloo", ranks=[replace(r, fsdp_unit_s=1e-4) for r in live.ranks])
    costs = measured_costs(gloo, analytic)
    assert costs.fsdp_unit_s == pytest.approx(1e-4)  # no pair measured: the one-rank figure
    own = next(k for k in live.links if k.nodes == ("a", "a"))
    link, units, extra = Link(own.bandwidth_gbs, own.latency_us, "gloo"), costs.n_layers + 1, 3e-3
    steps = 2 + 2  # a gather per pass, and a reduce-scatter that gloo runs as an all-reduce (2 ring steps)
    comm = steps * costs.stage_params(0, costs.n_layers) * 4 / 2 / (link.bandwidth_gbs * 1e9)
    comm += units * steps * link.latency_us * 1e-6
    pair = FsdpPairMeasurement("a", (0, 1), 0.05, 0.05 + comm + 2 * units * extra)
    speed_a = relative_speeds(live)["a"]
    assert fsdp_unit_overhead(replace(gloo, fsdp_pair=pair), costs, 1e-4) == pytest.approx(extra * speed_a)
    assert measured_costs(replace(gloo, fsdp_pair=pair), analytic).fsdp_unit_s == pytest.approx(extra * speed_a)
    # Issue 35: with no node of two ranks the pair spans two nodes (its record the slower member's, on b):
    # its collectives are priced by the a–b link, and b's seconds scaled to the fastest node's
    between = next(k for k in live.links if set(k.nodes) == {"a", "b"})
    wan = Link(between.bandwidth_gbs, between.latency_us, "gloo")
    comm = steps * costs.stage_params(0, costs.n_layers) * 4 / 2 / (wan.bandwidth_gbs * 1e9)
    comm += units * steps * wan.latency_us * 1e-6
    across = FsdpPairMeasurement("b", (0, 2), 0.15, 0.15 + comm + 2 * units * extra, across="a")
    speed_b = relative_speeds(live)["b"]
    assert fsdp_unit_overhead(replace(gloo, fsdp_pair=across), costs, 1e-4) == pytest.approx(extra * speed_b)


def test_the_activations_tp_keeps_whole_come_from_the_pairs_peaks(live: LiveProfile) -> None:
    """A sharded step allocating 0.7 of the plain one's peak at tp 2 keeps 40% of its activations whole
    (0.4 + 0.6 / 2); each tp rank's predicted activations follow it, and without a measurement the
    analytic share (Korthikanti's 10 of 34) stands."""
    from dataclasses import replace

    from tessera.plan import Plan
    from tessera.planner.costmodel import device_memory
    from tessera.planner.layout import layout_from_plan
    from tessera.planner.live.records import TensorParallelMeasurement

    analytic = ModelCosts.from_model(build_model("llama:4"), 16)
    pair = TensorParallelMeasurement("a", (0, 1), {2: 0.1}, {2: 0.1}, 1000, 700)
    costs = measured_costs(replace(live, tensor_parallel=pair), analytic)
    assert costs.tp_replicated_activations == pytest.approx(0.4)
    assert costs.tp_activation_share(2) == pytest.approx(0.7) and costs.tp_activation_share(4) == pytest.approx(0.55)
    assert measured_costs(live, analytic).tp_replicated_activations == pytest.approx(10 / 34)
    one_node = Cluster.from_dict({"nodes": [CLUSTER["nodes"][0]], "device_types": CLUSTER["device_types"]})
    cluster = measured_cluster(one_node, replace(live, ranks=live.ranks[:2], links=live.links[1:]))
    tp2, alone = (layout_from_plan(p, cluster, costs, 4) for p in (Plan(tp=2), Plan(placement=(0,))))
    activations = [device_memory(x, costs, x.replicas[0], 0)[1] for x in (tp2, alone)]
    block = costs.parts["block"].activation_bytes * 4 * costs.n_layers  # one micro-batch of 4, every block
    assert activations[1] - activations[0] == pytest.approx(0.3 * block)


def tensor_parallel_pair_worker() -> object:
    import torch.distributed as dist

    from tessera.planner.live.measure import measure_tensor_parallel

    group = dist.new_group([0, 1])
    return measure_tensor_parallel(build_model("llama:4"), 16, torch.device("cpu"), "a", (0, 1), group,
                                   batch_sizes=(1, 3), repeats=1, window_s=0.0)  # fmt: skip


def fsdp_pair_worker() -> object:
    import torch.distributed as dist

    from tessera.planner.live.measure import measure_fsdp_pair

    group = dist.new_group([0, 1])
    return measure_fsdp_pair(build_model("llama:4"), 16, torch.device("cpu"), "a", (0, 1), group, 1, 0.0)


def comm_overlap_worker() -> float:
    from tessera.planner.live.measure import measure_comm_overlap

    return measure_comm_overlap(torch.device("cpu"), nbytes=1 << 20, repeats=2)


def test_a_tensor_parallel_pair_is_timed_plain_and_sharded_together(live: LiveProfile, tmp_path: Path) -> None:
    """Both members of a real 2-rank group time the same sizes (a member running more collectives than
    the other would hang), and the profile's JSON keeps the measurement."""
    from dataclasses import replace

    from parity import run_shared

    workers = {"pair": tensor_parallel_pair_worker, "overlap": comm_overlap_worker, "fsdp": fsdp_pair_worker}
    results = run_shared(2, {name: (worker, ()) for name, worker in workers.items()})
    assert all(0.0 <= share <= 1.0 for share in results["overlap"]), results["overlap"]  # every rank returns
    for m in results["pair"]:
        assert (m.node, m.ranks) == ("a", (0, 1)) and set(m.plain_s) == set(m.sharded_s) == {1, 3}
        assert all(t > 0 for t in (*m.plain_s.values(), *m.sharded_s.values())), m
        assert 0 < m.sharded_peak_bytes < m.plain_peak_bytes, m  # the sharded step allocates less
    for f in results["fsdp"]:  # FSDP over the same real pair
        assert (f.node, f.ranks) == ("a", (0, 1)) and f.plain_s > 0 and f.sharded_s > 0, f
    kept = replace(live, tensor_parallel=m, fsdp_pair=f)
    assert LiveProfile.load(kept.save(tmp_path / "live.json")) == kept


def test_a_profile_knows_whether_other_processes_used_the_cpu_while_it_measured(
    live: LiveProfile, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35: on a busy machine a live profile mis-measured the speeds and the plan lost to uniform DDP with no
    warning. Another process's load counts; the launcher's own children's (waited for inside) do not."""
    import subprocess
    import sys
    import time

    from tessera.planner.live import quiet
    from tessera.planner.live.quiet import BUSY_CORES, CpuWatch

    spin = [sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"]
    other = subprocess.Popen(spin)  # started outside the watch: someone else's process
    time.sleep(0.2)
    with CpuWatch() as watch:
        time.sleep(0.8)
    other.wait()
    assert watch.busy and watch.others_cores > BUSY_CORES, watch.others_cores
    # The arithmetic, on given counters: 3 s of the machine's busy time in 2 s of wall, 2.5 of them the
    # launcher's and the ranks' it waited for: others used 0.25 cores, which is not over the line.
    now = {"clock": 100.0, "machine": 10.0, "own": 50.0}
    monkeypatch.setattr(quiet, "_clock", lambda: now["clock"])
    monkeypatch.setattr(quiet, "machine_busy_s", lambda: now["machine"])
    monkeypatch.setattr(quiet, "own_busy_s", lambda: now["own"])
    with CpuWatch() as own:
        now.update(clock=102.0, machine=13.0, own=52.5)
    assert own.others_cores == pytest.approx(0.25) and not own.busy
    saved = live.save(tmp_path / "live.json")
    LiveProfile.record_other_load(saved, watch.others_cores)
    assert LiveProfile.load(saved).other_cpu_cores == pytest.approx(watch.others_cores, abs=1e-3)


def test_tessera_plan_repeats_the_busy_warning_of_a_profile(live: LiveProfile, tmp_path: Path, capsys) -> None:
    """A profile whose launcher saw other processes' load is planned from with a warning; a quiet one without."""
    import yaml

    from tessera.cli import main

    config = {
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
        "data": {"seq_len": 16},
        "train": {"global_batch_size": 8},
    }  # the fixture's profiled model
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(CLUSTER))
    said = []
    for cores in (0.0, 1.5):
        saved = live.save(tmp_path / "live.json")
        LiveProfile.record_other_load(saved, cores)
        argv = ["plan", "--model", str(tmp_path / "c.yaml"), "--cluster", str(tmp_path / "cluster.yaml"),
                "--global-batch", "8", "--profile", str(saved), "--out", str(tmp_path / "plan.yaml"),
                "--png", str(tmp_path / "plan.png")]  # fmt: skip
        assert main(argv) == 0
        said.append("other processes used 1.50 CPU cores" in capsys.readouterr().out)
    assert said == [False, True]
    # The profile's own spread (each rank timed the same pass at its start and end): saved, read back, and
    # told with the plans it cannot separate from plan 0.
    from dataclasses import replace

    drifted = [replace(r, recheck_s=(1.0, 1.0 + d)) for r, d in zip(live.ranks, (0.01, -0.4, 0.03))]
    saved = replace(live, ranks=drifted).save(tmp_path / "live.json")
    assert LiveProfile.load(saved).spread == pytest.approx(0.4) and live.spread == 0.0
    assert main([*argv[:-6], "--profile", str(saved), *argv[-4:], "--top", "10"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if "the profile's own spread is 40.0%" in line)
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit() and "best plans" not in line]
    steps = [float(row.split()[1]) for row in rows]
    tied = [i for i, step in enumerate(steps) if step <= steps[0] * 1.4]
    assert len(tied) > 1 and f"plans {', '.join(map(str, tied))} are predicted within it" in note, (note, steps)


def test_whole_model_timings_take_a_hugging_face_model_s_output() -> None:
    """The profile's whole-model timings (the spread's recheck, the FSDP and tp pairs) run Hugging Face models
    too, whose forward returns an output object: `tessera cluster profile` failed on GPT-2 before."""
    from tessera.planner.live.measure import _transient_bytes, whole_pass_seconds

    model = build_model("gpt2:2")
    assert whole_pass_seconds(model, 16, torch.device("cpu"), repeats=1, window_s=0.0) > 0
    assert _transient_bytes(model, torch.zeros(1, 16, dtype=torch.long), torch.device("cpu")) > 0
