"""Heterogeneous-issue part 3: cost model, simulator and search.

The planner's best plan must equal the exhaustive optimum under the cost model on generated
small clusters, never exceed a device's memory, agree with the simulator, and hand the runtime a
Plan that describes exactly the layout it costed.
"""

from __future__ import annotations

import math

import pytest
import torch

from tessera import Hybrid, PlanError
from tessera.cluster import Cluster
from tessera.cluster.generate import random_cluster
from tessera.models.llama import Llama, LlamaConfig
from tessera.planner.costmodel import estimate
from tessera.planner.costs import ModelCosts
from tessera.planner.layout import layout_from_plan
from tessera.planner.search import exhaustive_search, search
from tessera.planner.simulate import simulate

MICROBATCHES = (1, 2, 4)
BATCH = 8
# Clusters whose exhaustive search takes seconds, not minutes, on two cores (seeds 0, 2 and 23
# have 8 devices on three nodes of three types: the benchmark covers them).
SEEDS = [s for s in range(30) if s not in (0, 2, 23)]


@pytest.fixture(scope="module")
def costs() -> ModelCosts:
    """A 4-layer, 1.7 B-parameter-per-layer-class Llama: big enough that memory binds on the small devices."""
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=4, dim=2048, n_heads=16, n_kv_heads=16, ffn_dim=8192, vocab_size=32000))
    return ModelCosts.from_model(model, seq_len=2048, precision="fp16")


def test_generated_clusters_are_varied() -> None:
    clusters = [random_cluster(s) for s in SEEDS]
    assert len(clusters) >= 20
    assert all(c.world_size <= 8 for c in clusters)
    assert len({n.device_type for c in clusters for n in c.nodes}) >= 5
    assert sum(len({n.device_type for n in c.nodes}) > 1 for c in clusters) >= 12


@pytest.mark.parametrize("seed", SEEDS)
def test_best_plan_equals_exhaustive_optimum_and_fits(costs: ModelCosts, seed: int) -> None:
    cluster = random_cluster(seed)
    found = search(cluster, costs, BATCH, top=5, microbatches=MICROBATCHES)
    optimum, layout = exhaustive_search(cluster, costs, BATCH, microbatches=MICROBATCHES)
    assert layout is not None
    assert math.isclose(found[0].estimate.step_s, optimum, rel_tol=1e-9), (found[0].estimate.step_s, optimum)
    steps = [c.estimate.step_s for c in found]
    assert steps == sorted(steps)
    for candidate in found:
        assert candidate.estimate.fits, candidate.estimate.over_memory
        assert all(m.total <= m.capacity for m in candidate.estimate.memory)


@pytest.mark.parametrize("seed", SEEDS[:8])
def test_returned_plan_describes_the_layout_it_was_costed_as(costs: ModelCosts, seed: int) -> None:
    """The runtime gets a Plan; rebuilt from that Plan on the cluster, the layout costs the same."""
    cluster = random_cluster(seed)
    for candidate in search(cluster, costs, BATCH, top=3, microbatches=MICROBATCHES):
        rebuilt = layout_from_plan(candidate.plan, cluster, costs, BATCH)
        assert math.isclose(estimate(rebuilt, costs).step_s, candidate.estimate.step_s, rel_tol=1e-9)
        assert rebuilt.global_batch == BATCH


def _plans_for_agreement() -> list:
    return [
        Hybrid(pp=2, microbatches=4),
        Hybrid(pp=2, microbatches=8, stages=[(0, 3), (3, 4)]),
        Hybrid(pp=4, microbatches=8),
        Hybrid(pp=4, microbatches=2, schedule="gpipe"),
        Hybrid(pp=2, tp=2, microbatches=4, zero=3),
        Hybrid(dp_shares=[6, 6, 2, 2]),
        Hybrid(pp=2, microbatches=2, dp_shares=[4, 4], stages=[(0, 1), (1, 4)], recompute="full"),
    ]


def test_simulator_and_cost_model_agree_within_five_percent(costs: ModelCosts) -> None:
    cluster = Cluster.from_dict(
        {
            "nodes": [
                {"name": "a", "devices": [{"type": "A100-80GB", "count": 2}]},
                {"name": "b", "devices": [{"type": "T4", "count": 2}]},
            ]
        }
    )
    layouts = [layout_from_plan(p, cluster, costs, 16) for p in _plans_for_agreement()]
    # Every seed's top five, up to 8 micro-batches: cross-region pipelines whose tightest 1f1b loop
    # is a short one were 15% off before the flow term counted every loop.
    layouts += [
        c.layout for s in range(30) for c in search(random_cluster(s), costs, BATCH, top=5, microbatches=(1, 2, 4, 8))
    ]
    assert len(layouts) >= 120
    for layout in layouts:
        model, sim = estimate(layout, costs).step_s, simulate(layout, costs).step_s
        assert abs(model - sim) / sim <= 0.05, (layout, model, sim)


def test_simulator_replays_the_schedule_not_the_formula(costs: ModelCosts) -> None:
    """gpipe and 1f1b differ in order, not makespan; a slow middle stage shows in both the same way."""
    cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "A100-80GB", "count": 4}]}]})
    one = layout_from_plan(Hybrid(pp=4, microbatches=8), cluster, costs, 16)
    sim = simulate(one, costs)
    forwards = [e for e in sim.events if e.kind == "forward" and e.stage == 3]
    backwards = [e for e in sim.events if e.kind == "backward" and e.stage == 0]
    assert len(forwards) == 8 and len(backwards) == 8
    # 1f1b: the last stage runs a backward right after each forward.
    order = sorted((e.start, e.kind) for e in sim.events if e.stage == 3 and e.kind in ("forward", "backward"))
    assert [k for _, k in order[:4]] == ["forward", "backward", "forward", "backward"]
    for e in sim.events:
        assert e.end >= e.start


def test_memory_verdict_sees_what_zero_and_recompute_save(costs: ModelCosts) -> None:
    cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "A10", "count": 4}]}]})
    totals = {}
    for zero in range(4):
        layout = layout_from_plan(Hybrid(zero=zero), cluster, costs, 8)
        totals[zero] = estimate(layout, costs).memory[0].model_state
    assert totals[0] > totals[1] > totals[2] > totals[3]
    plain = estimate(layout_from_plan(Hybrid(zero=3), cluster, costs, 8), costs).memory[0].activations
    recompute = estimate(layout_from_plan(Hybrid(zero=3, recompute="full"), cluster, costs, 8), costs).memory[0]
    assert recompute.activations < plain / 2  # the logits of the last part are kept either way


def test_global_batch_smaller_than_every_data_parallel_size_is_refused(costs: ModelCosts) -> None:
    cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "T4", "count": 5}]}]})
    # 5 devices: 4 layers allow no pipeline of 5 and tp must divide 5, so dp = 5.
    with pytest.raises(PlanError, match=r"global_batch_size=3 is smaller than .*at least 5"):
        search(cluster, costs, 3)


def test_device_without_the_precision_is_refused(costs: ModelCosts) -> None:
    cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "T4", "count": 2}]}]})
    with pytest.raises(PlanError, match="T4 has no bf16 figure"):
        search(cluster, costs.with_precision("bf16"), 8)


def test_bf16_beside_devices_without_it_plans_fp16_with_loss_scaling_unless_pinned() -> None:
    from tessera.planner import plan_for

    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=4, dim=256, n_heads=4, n_kv_heads=4, ffn_dim=512, vocab_size=1000))
    mixed = Cluster.from_dict(
        {"nodes": [{"name": "a", "devices": [{"type": "A100-80GB", "count": 2}]},
                   {"name": "b", "devices": [{"type": "V100", "count": 2}]}]}
    )  # fmt: skip
    for asked in ("bf16", "auto"):
        best = plan_for(mixed, model, 16, seq_len=128, precision=asked, top=1)[0]
        assert best.plan.precision == "fp16", asked
        assert any("fp16 with dynamic loss scaling: V100 has no bf16" in n for n in best.notes), best.notes
    with pytest.raises(PlanError, match="V100 has no bf16 figure"):
        plan_for(mixed, model, 16, seq_len=128, precision="bf16", top=1, pin_precision=True)
    alike = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "A100-80GB", "count": 2}]}]})
    best = plan_for(alike, model, 16, seq_len=128, precision="auto", top=1)[0]
    assert best.plan.precision == "bf16" and not best.notes
    no_half = {
        **mixed.to_dict(),
        "device_types": {"old": {"peak_tflops": {"fp32": 10}, "memory_gib": 16, "bandwidth_gbs": 500}},
    }
    no_half["nodes"][1]["devices"][0]["type"] = "old"
    best = plan_for(Cluster.from_dict(no_half), model, 16, seq_len=128, precision="auto", top=1)[0]
    assert best.plan.precision == "fp32" and "old has no half-precision figure" in best.notes[0]


@pytest.mark.parametrize("seed", SEEDS[:10])
def test_placements_on_several_machines_are_launchable_by_torchrun(costs: ModelCosts, seed: int) -> None:
    """torchrun numbers ranks machine by machine: each node's devices must take consecutive ranks, in order."""
    cluster = random_cluster(seed)
    devices = cluster.devices()
    for candidate in search(cluster, costs, BATCH, top=5, microbatches=MICROBATCHES):
        plan = candidate.plan
        runs: list[tuple[str, list[int]]] = []
        for rank in range(cluster.world_size):
            device = plan.device_of(rank)
            node = devices[device][0]
            if not runs or runs[-1][0] != node:
                runs.append((node, []))
            runs[-1][1].append(device)
        assert len(runs) == len({node for node, _ in runs}), runs
        assert all(ds == sorted(ds) for _, ds in runs), runs


def test_runtime_maps_a_placed_rank_to_its_gpu(monkeypatch) -> None:
    from tessera.distributed import _placed_local_index

    # Two machines of 2 GPUs; the plan puts node 1's devices (2, 3) on ranks 0-1.
    for rank, local in ((0, 0), (1, 1), (2, 0), (3, 1)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("WORLD_SIZE", "4")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert _placed_local_index((2, 3, 0, 1)) == local
    with pytest.raises(PlanError, match="not one node's devices in order"):
        _placed_local_index((2, 0, 3, 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one machine: any placement, the device it names
    monkeypatch.setenv("RANK", "1")
    assert _placed_local_index((2, 0, 3, 1)) == 0


def test_replicas_of_different_depth_are_planned_where_they_win(costs: ModelCosts, tmp_path) -> None:
    """Seed 19: one A100-80GB beside 2 + 4 T4s over two regions (7 devices: no dp × pp grid but dp 7).
    The best plan gives each pool its own pipeline depth, beats every grid plan, and is costed,
    simulated and rebuilt from its Plan alike."""
    from tessera.planner.draw import draw

    cluster = random_cluster(19)
    found = search(cluster, costs, BATCH, top=60, microbatches=MICROBATCHES)
    best = found[0]
    assert best.plan.replicas is not None
    assert sorted(r.depth for r in best.plan.replicas) == [1, 2, 4], best.placement
    grid = next(c for c in found if c.plan.replicas is None)
    assert best.estimate.step_s < grid.estimate.step_s * 0.8
    assert best.plan.resolve(cluster.world_size).dp == 3
    rebuilt = layout_from_plan(best.plan, cluster, costs, BATCH)
    assert math.isclose(estimate(rebuilt, costs).step_s, best.estimate.step_s, rel_tol=1e-9)
    sim = simulate(best.layout, costs).step_s
    assert abs(sim - best.estimate.step_s) / sim <= 0.05
    assert {(e.replica, e.stage) for e in simulate(best.layout, costs).events} == {
        (r, s) for r, replica in enumerate(best.plan.replicas) for s in range(replica.depth)
    }
    assert draw(best, cluster, costs, tmp_path / "mixed.png").read_bytes()[:4] == b"\x89PNG"


def test_zero1_sync_adds_the_owners_broadcasts(costs: ModelCosts) -> None:
    """Tessera's ZeRO-1 all-reduces gradients whole, then broadcasts every parameter piece from its
    owner: an all-gather's volume plus one collective's latency per parameter tensor."""
    from tessera.planner.layout import grad_sync_s

    cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "A10", "count": 4}]}]})
    plain, zero1 = (layout_from_plan(Hybrid(zero=z), cluster, costs, 8) for z in (0, 1))
    link, n = plain.dp_links[0], costs.n_layers
    tensors = costs.stage_tensors(0, n)
    assert tensors == 3 + 9 * n  # embedding, final norm, head; nine per Llama block
    extra = link.all_reduce_s(4 * costs.stage_params(0, n), 4) / 2 + tensors * link.latency_us * 1e-6
    assert grad_sync_s(zero1, costs, 0) == pytest.approx(grad_sync_s(plain, costs, 0) + extra, rel=1e-12)


def test_fsdp_collectives_per_unit_and_micro_batch_without_a_pipeline(costs: ModelCosts) -> None:
    """FSDP gathers every unit (each block, and the root) for each micro-batch's forward, and under
    ZeRO-3 again for its backward, and reduce-scatters once: each collective half an all-reduce's
    volume of its unit, and dp − 1 latencies."""
    from tessera.planner.layout import grad_sync_s

    cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": "A10", "count": 4}]}]})
    link, n = cluster.links["intra_node"], costs.n_layers
    half_volume = 3 / 4 * 4 * costs.stage_params(0, n) / (link.bandwidth_gbs * 1e9)
    latencies = (n + 1) * 3 * link.latency_us * 1e-6
    for zero, m, uses in ((2, 1, 2), (2, 4, 5), (3, 1, 3), (3, 4, 9)):
        layout = layout_from_plan(Hybrid(zero=zero, microbatches=m), cluster, costs, 16)
        assert grad_sync_s(layout, costs, 0) == pytest.approx(uses * (half_volume + latencies), rel=1e-12), (zero, m)
