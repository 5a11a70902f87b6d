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
from tessera.cluster.emulate import EmulatedOutOfMemory, Emulator
from tessera.planner import plan_for

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
    best = Auto(cluster_file, model, global_batch_size=BATCH)
    # The runners-up too: uneven shares with a different placement.
    others = [c.plan for c in plan_for(cluster_file, model, BATCH, top=8)[1:] if c.plan.dp_shares is not None]
    plans = [best, *others[:2]]
    assert any(p.placement is not None for p in plans), "no plan moves devices on the mesh: the test would not see it"
    assert any(p.dp_shares is not None for p in plans)
    assert any(p.pp > 1 and len({e - s for s, e in p.pipeline.stages}) > 1 for p in plans)
    monkeypatch.setenv("TESSERA_EMULATE", str(cluster_file))  # inherited by the spawned ranks
    cases = [(f"plan{i}", p.to_dict(), "llama:4", None) for i, p in enumerate(plans)]
    check_cases(4, cases, BATCH, steps=2)


def test_emulator_slows_each_block_by_the_speed_ratio() -> None:
    import torch

    model = build_model("llama:2")
    emulator = Emulator(Cluster.from_dict(SPEEDS), rank=3)  # the quarter-speed device
    assert emulator.slowdown == 4.0
    assert "quarter: blocks take 4x" in emulator.describe()
    emulator.slow_down(model.layers)
    x = torch.randint(0, 100, (2, 16))
    loss_fn(model(x), x).backward()
    assert emulator.slowed == {"forward": 2, "backward": 2}
    # Each block is stretched to 4x its CPU time: the sleeps make up at most the other 3x.
    assert 0 < emulator.slept_s <= 3 * emulator.compute_s * 1.01 + 1e-4  # clocks tick in microseconds


def test_emulated_memory_accountant_refuses_what_does_not_fit() -> None:
    spec = {
        **SPEEDS,
        "device_types": {
            **SPEEDS["device_types"],
            "full": {"peak_tflops": {"fp32": 4}, "memory_gib": 1e-5, "bandwidth_gbs": 1},
        },
    }
    emulator = Emulator(Cluster.from_dict(spec), rank=0)
    model = build_model("llama:2")
    with pytest.raises(EmulatedOutOfMemory, match=r"emulated a:0 \(full.*GiB of model state"):
        emulator.check_memory(model)
    assert Emulator(Cluster.from_dict(SPEEDS), rank=0).check_memory(model) > 0
