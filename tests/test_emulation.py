"""Heterogeneous-issue part 4: planner output runs on emulated devices and trains exactly like one process.

Four local ranks play a cluster of speeds 1, 1, ½ and ¼; the plan the planner returns (uneven
pipeline stages, devices placed on the mesh, uneven shares) must change speed, never results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from parity import GLOBAL_BATCH_DEFAULT, build_model, check_cases, loss_fn

from tessera import Auto
from tessera.cluster import Cluster
from tessera.planner import plan_for
from tessera.testbed.emulate import EmulatedOutOfMemory, EmulationHooks, Emulator

SPEEDS = {
    "nodes": [
        {"name": "a", "devices": [{"type": "full", "count": 2}]},
        {"name": "b", "devices": [{"type": "half", "count": 1}]},
        {"name": "c", "devices": [{"type": "quarter", "count": 1}]},
    ],
    "device_types": {
        "full": {"peak_tflops": {"fp32": 4}, "memory_gib": 1, "bandwidth_gbs": 100},
        "half": {"peak_tflops": {"fp32": 2}, "memory_gib": 1, "bandwidth_gbs": 100},
        "quarter": {"peak_tflops": {"fp32": 1}, "memory_gib": 1, "bandwidth_gbs": 100},
    },
    "links": {
        "intra_node": {"bandwidth_gbs": 10, "latency_us": 100},
        "inter_node": {"bandwidth_gbs": 10, "latency_us": 100},
    },
}
BATCH = 2 * GLOBAL_BATCH_DEFAULT


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(SPEEDS))
    return path


def test_planner_output_trains_like_one_process_on_emulated_devices(cluster_file: Path, monkeypatch) -> None:
    model = build_model("llama:4")
    best = Auto(cluster_file, model, global_batch_size=BATCH, use_every_device=True)  # 4 ranks: every device
    # The runners-up too: uneven shares with a different placement.
    runners_up = plan_for(cluster_file, model, BATCH, top=8, use_every_device=True)[1:]
    others = [c.plan for c in runners_up if c.plan.dp_shares is not None]
    # And replicas whose pipelines differ in depth (two full-speed devices as one two-stage pipeline).
    mixed = next(
        c.plan
        for c in plan_for(cluster_file, model, BATCH, top=40, use_every_device=True)
        if c.plan.replicas is not None and len({r.depth for r in c.plan.replicas}) > 1
    )
    plans = [best, *others[:2], mixed]
    assert any(p.placement is not None for p in plans), "no plan moves devices on the mesh: the test would not see it"
    assert any(p.dp_shares is not None for p in plans)
    assert any(p.pp > 1 and len({e - s for s, e in p.pipeline.stages}) > 1 for p in plans)
    monkeypatch.setenv("TESSERA_EMULATE", str(cluster_file))  # inherited by the spawned ranks
    cases = [(f"plan{i}", p.to_dict(), "llama:4", None) for i, p in enumerate(plans)]
    # The emulated links' hooks (FSDP's collectives, pipeline transfers) must not change results either.
    cases += [
        ("zero3", {"zero": 3}, "llama:4", None),
        ("pp2", {"pp": 2, "pipeline": {"microbatches": 2}}, "llama:4", None),
    ]
    check_cases(4, cases, BATCH, steps=2)


def test_emulator_slows_each_block_by_the_speed_ratio() -> None:
    import torch

    model = build_model("llama:2")
    emulator = Emulator(Cluster.from_dict(SPEEDS), rank=3)  # the quarter-speed device
    assert emulator.slowdown == 4.0
    assert "quarter: blocks take 4x" in emulator.describe()
    emulator.slow_down(model.layers)
    timed = _time_forwards(model.layers)  # registered after the emulator's: the end includes its sleep
    x = torch.randint(0, 100, (2, 16))
    loss_fn(model(x), x).backward()
    assert emulator.slowed == {"forward": 2, "backward": 2}
    # Each block is stretched to 4x its CPU time: the sleeps make up at most the other 3x ...
    assert 0 < emulator.slept_s <= 3 * emulator.compute_s * 1.01 + 1e-4  # clocks tick in microseconds
    # ... and at least that: timed from outside, every forward took 4x the CPU it used.
    for wall, cpu in timed:
        assert wall >= 0.9 * 4 * cpu, (wall, cpu)


def _time_forwards(blocks) -> list[tuple[float, float]]:
    """(wall, thread CPU) seconds of every forward of ``blocks``, measured by hooks of the test's own."""
    import time

    timed, began = [], {}

    def start(module, args) -> None:
        began[id(module)] = (time.perf_counter(), time.thread_time())

    def stop(module, args, output) -> None:
        wall, cpu = began[id(module)]
        timed.append((time.perf_counter() - wall, time.thread_time() - cpu))

    for block in blocks:
        block.register_forward_pre_hook(start)
        block.register_forward_hook(stop)
    return timed


def test_emulated_memory_accountant_refuses_what_does_not_fit() -> None:
    import torch

    spec = {
        **SPEEDS,
        "device_types": {
            **SPEEDS["device_types"],
            "full": {"peak_tflops": {"fp32": 4}, "memory_gib": 1e-5, "bandwidth_gbs": 1},
        },
    }
    emulator = Emulator(Cluster.from_dict(spec), rank=0)
    model = build_model("llama:2")
    with pytest.raises(EmulatedOutOfMemory, match=r"emulated a:0 \(full.*GiB .*params=.*activations"):
        emulator.check_memory(model)
    roomy = Emulator(Cluster.from_dict(SPEEDS), rank=0)
    roomy.track_activations(model.parameters())
    state = roomy.check_memory(model)
    x = torch.randint(0, 100, (4, 16))
    loss = loss_fn(model(x), x)
    with_activations = roomy.check_memory(model)
    assert with_activations > state  # the forward's saved tensors count until the next check
    loss.backward()
    assert roomy.check_memory(model) > state  # now gradients; activations freed
    roomy._saved_hooks.__exit__(None, None, None)


def test_emulator_with_a_block_line_targets_that_line_scaled_by_speed() -> None:
    import torch

    model = build_model("llama:2")
    emulator = Emulator(Cluster.from_dict(SPEEDS), rank=2, block_s=(0.01, 0.005, 2.0))  # half speed: 80 ms per forward
    emulator.slow_down(model.layers)
    timed = _time_forwards(model.layers)
    x = torch.randint(0, 100, (6, 16))
    loss_fn(model(x), x).backward()
    assert len(timed) == 2 and all(wall >= 0.9 * (0.01 + 0.005 * 6) * 2 for wall, _ in timed), timed
    block = model.layers[0]
    assert emulator._target(block, "forward", cpu=0.0) == pytest.approx((0.01 + 0.005 * 6) * 2)
    assert emulator._target(block, "backward", cpu=0.0) == pytest.approx((0.01 + 0.005 * 6) * 2 * 2.0)
    assert emulator.slowed == {"forward": 2, "backward": 2} and emulator.slept_s > 0


def _link_worker(cluster_path: str) -> float:
    import torch

    import tessera

    hooks = EmulationHooks(cluster_path)
    booster = tessera.Booster(tessera.DDP(), hooks=hooks)
    model = build_model("llama:2")
    model, opt = booster.boost(model, torch.optim.AdamW(model.parameters()))
    x = torch.randint(0, 100, (4, 16))
    booster.backward(loss_fn(model(x), x), opt)
    return hooks.emulator.link_s


def test_emulated_slow_link_delays_gradient_all_reduce(tmp_path: Path) -> None:
    from tessera.testing import run_ranks

    spec = {
        "nodes": [
            {"name": "a", "devices": [{"type": "full", "count": 1}]},
            {"name": "b", "devices": [{"type": "full", "count": 1}]},
        ],
        "device_types": SPEEDS["device_types"],
        "links": {"inter_node": {"bandwidth_gbs": 0.1, "latency_us": 1000}},
    }
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(spec))
    delays = run_ranks(_link_worker, 2, str(path))
    n_bytes = 4 * sum(p.numel() for p in build_model("llama:2").parameters())
    # One ring all-reduce of every gradient over 0.1 GB/s (buckets add a millisecond of latency each).
    expected = n_bytes / 0.1e9
    for delay in delays:
        assert expected + 2e-3 <= delay <= expected + 2e-3 * 8, (delay, expected)


def _layout_links_worker(cluster_path: str, plans: list[dict]) -> list[float]:
    """One step of each plan on emulated devices; each rank's seconds of emulated link delay per plan."""
    import torch

    import tessera

    delays = []
    for plan in plans:
        hooks = EmulationHooks(cluster_path)
        booster = tessera.Booster(tessera.Plan.from_dict(plan), hooks=hooks)
        model = build_model("llama:2")
        model, opt = booster.boost(model, torch.optim.AdamW(model.parameters()))
        x = torch.randint(0, 100, (8, 16))
        booster.execute_pipeline((x, x), model, loss_fn, opt)
        delays.append(hooks.emulator.link_s)
    return delays


def test_emulated_links_delay_sharding_pipelines_and_replicas(tmp_path: Path) -> None:
    """FSDP's gathers and reduce-scatters, a pipeline's transfers and gradient averaging, and the
    per-layer averaging of replicas of different depth all wait for the emulated link."""
    from tessera.parallel.data_parallel import repeated_blocks
    from tessera.testing import run_ranks

    spec = {
        **SPEEDS,
        "links": {
            "intra_node": {"bandwidth_gbs": 0.5, "latency_us": 100},
            "inter_node": {"bandwidth_gbs": 0.5, "latency_us": 100},
        },
    }
    path = tmp_path / "links.yaml"
    path.write_text(yaml.safe_dump(spec))
    plans = [
        {"zero": 3},
        {"zero": 3, "pipeline": {"microbatches": 2}},
        {"pp": 2, "pipeline": {"microbatches": 2}},
        {
            "replicas": [{"stages": [[0, 1], [1, 2]]}, {"stages": [[0, 2]]}, {"stages": [[0, 2]]}],
            "pipeline": {"microbatches": 2},
        },
    ]
    delays = run_ranks(_layout_links_worker, 4, str(path), plans)
    # ZeRO-3: per unit (block or root) and micro-batch, a gather before forward and before backward; one reduce-scatter
    # after the backward that synchronises (not inside no_sync). Each is half a ring all-reduce of
    # the block's fp32 parameters over 4 devices: 1.5 all-reduces for one micro-batch, 2.5 for two.
    link = Cluster.from_dict(spec).links["inter_node"]
    model = build_model("llama:2")
    blocks = repeated_blocks(model)
    unit_bytes = [4 * sum(p.numel() for p in b.parameters()) for b in blocks]
    unit_bytes.append(4 * sum(p.numel() for p in model.parameters()) - sum(unit_bytes))  # the root unit
    one = sum(link.all_reduce_s(n, 4) for n in unit_bytes)
    for rank, (zero3, zero3_two, pipeline, replicas) in enumerate(delays):
        assert zero3 == pytest.approx(1.5 * one, rel=1e-9), rank
        assert zero3_two == pytest.approx(2.5 * one, rel=1e-9), rank
        assert pipeline > 0 and replicas > 0, (rank, pipeline, replicas)


def test_links_that_are_this_machines_own_are_left_as_they_are(monkeypatch, cluster_file: Path) -> None:
    monkeypatch.setenv("TESSERA_EMULATE_LINKS", "0")
    emulator = Emulator.from_environment(cluster_file, 0, "fp32")
    emulator.delay_all_reduce([0, 3], 1 << 20)
    assert not emulator.links and emulator.link_s == 0.0
    monkeypatch.delenv("TESSERA_EMULATE_LINKS")
    emulator = Emulator.from_environment(cluster_file, 0, "fp32")
    emulator.delay_all_reduce([0, 3], 1 << 20)
    assert emulator.link_s > 0
