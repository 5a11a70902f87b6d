"""Data-parallel replicas whose pipelines differ in depth (Plan.replicas, the Zorse plan shape).

Every layout here must train exactly like one process: a layer's gradient is averaged over the
ranks that hold it, one in each replica, whatever pipeline position it has there.
"""

from __future__ import annotations

import pytest
from parity import check_cases

from tessera.errors import NotSupportedYet, PlanError
from tessera.plan import Plan, Replica


def _replica(*stages: tuple[int, int], share: int = 1) -> Replica:
    return Replica(tuple(stages), share)


def test_replicas_of_different_depth_train_like_one_process() -> None:
    cases = [
        # One rank with every layer next to a two-stage pipeline (uneven stages), uneven shares.
        (
            "whole_and_two_stages",
            Plan(replicas=(_replica((0, 4), share=3), _replica((0, 1), (1, 4))), pipeline={"microbatches": 2}),
            "llama:4",
            None,
        ),
        # Tied embeddings: the copies sit on both stages of one replica and on the other's single rank;
        # gpipe, and clipping that bites.
        (
            "tied_gpipe_clipped",
            Plan(
                replicas=(_replica((0, 2), (2, 4)), _replica((0, 4), share=3)),
                pipeline={"microbatches": 2, "schedule": "gpipe"},
            ),
            "llama_tied:4",
            0.5,
        ),
        (
            "gpt2",
            Plan(replicas=(_replica((0, 4)), _replica((0, 3), (3, 4), share=3)), pipeline={"microbatches": 2}),
            "gpt2:4",
            None,
        ),
        # Compiled blocks in every stage (the block graph of test_compiled_blocks, for other batch sizes).
        (
            "whole_and_two_stages_compiled",
            Plan(
                replicas=(_replica((0, 4), share=3), _replica((0, 1), (1, 4))),
                pipeline={"microbatches": 2},
                compile="blocks",
            ),
            "llama:4",
            None,
        ),
        # Tensor parallelism per replica (tp per node kind): a tp2 replica beside a one-rank one, each order;
        # the one-rank replica's gradient averaged with the tp ranks' shards piece by piece, clipping that bites.
        ("tp2_and_whole", Plan(replicas=(Replica(((0, 4),), share=3, tp=2), _replica((0, 4)))), "llama:4", None),
        (
            "whole_and_tp2_clipped",
            Plan(replicas=(_replica((0, 4)), Replica(((0, 4),), share=3, tp=2))),
            "llama:4",
            0.5,
        ),
    ]
    results = check_cases(3, [(name, plan.to_dict(), kind, clip) for name, plan, kind, clip in cases], 16, steps=2)
    assert results["whole_and_two_stages_compiled"]["compiled_graphs"] > 0, "the compiled replica ran eager"


def checkpoint_worker(root: str) -> list[dict]:
    """Train one step with replicas of depth 1 and 2 (and, apart, a tp2 replica beside a whole one) and save;
    load each under DDP on the same 3 ranks."""
    import torch
    from parity import TokenData, build_model, loss_fn, make_optimizer

    import tessera
    from tessera.checkpoint import load_checkpoint, save_checkpoint

    def boosted(plan: Plan, kind: str):
        booster = tessera.Booster(plan)
        model = build_model(kind)  # the same initial weights everywhere: only loading can add the step
        model, opt = booster.boost(model, make_optimizer(model.parameters()))
        return booster, model, opt

    out = []
    for name, kind, plan in (
        ("depths", "llama_tied:4", Plan(replicas=(_replica((0, 1), (1, 4)), _replica((0, 4), share=2)),
                                        pipeline={"microbatches": 2})),
        ("tp", "llama:4", Plan(replicas=(Replica(((0, 4),), tp=2), _replica((0, 4), share=2)))),
    ):  # fmt: skip
        booster, model, opt = boosted(plan, kind)
        batch = next(iter(booster.dataloader(TokenData(), global_batch_size=12)))
        booster.execute_pipeline(batch, model, loss_fn, opt)
        opt.step()
        saved = booster.full_state_dict(model)
        path = save_checkpoint(f"{root}/{name}", 1, model, opt, {"step": 1}, keep=1, meta={})
        other_booster, other, other_opt = boosted(tessera.DDP(), kind)
        load_checkpoint(path, other, other_opt)
        moments = {n: other_opt.state[p]["exp_avg"].clone() for n, p in other.module.named_parameters()}
        loaded = other_booster.full_state_dict(other)
        if name == "tp":  # and back: the tp replica's shards from the whole tensors
            again_booster, again, again_opt = boosted(plan, kind)
            load_checkpoint(path, again, again_opt)
            assert again_booster.full_state_dict(again).keys() == saved.keys()
            for k, v in again_booster.full_state_dict(again).items():
                assert torch.equal(v, saved[k]), f"{k} differs after loading back under tp replicas"
        out.append({"saved": saved, "loaded": loaded, "moments": moments})
    return out


def test_checkpoint_saved_under_replicas_loads_under_ddp(tmp_path) -> None:
    import torch

    from tessera.testing import run_ranks

    results = run_ranks(checkpoint_worker, 3, str(tmp_path))
    for result in (r for per_rank in results for r in per_rank):
        assert result["loaded"].keys() == result["saved"].keys()
        for k, v in result["saved"].items():
            assert torch.equal(result["loaded"][k], v), f"{k} differs from the replicas checkpoint"
        assert all(m.abs().sum() > 0 for m in result["moments"].values()), "Adam's moments were not loaded"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"replicas": [{"stages": [[0, 4]]}, {"stages": [[0, 2], [2, 5]]}]}, "every replica must hold the whole"),
        ({"replicas": [{"stages": [[0, 2], [2, 4]]}]}, r"replicas\[0\]: .*at least as many micro-batches"),
        ({"replicas": [{"stages": [[0, 4]], "share": 0}]}, r"replicas\[0\].share must be >= 1"),
        ({"replicas": [{"stages": [[0, 2], [3, 4]]}]}, r"replicas\[0\].stages.*gap"),
        ({"replicas": [{"layers": [[0, 4]]}]}, r"replicas\[0\] has no stages"),
        ({"replicas": [{"stages": [[0, 4]]}], "pp": 2}, "Plan.pp must stay 1"),
        ({"replicas": [{"stages": [[0, 4]]}], "dp_shares": [1]}, "Plan.dp_shares must stay None"),
        ({"replicas": [{"stages": [[0, 4]]}], "pipeline": {"schedule": "interleaved_1f1b"}}, "one stage per"),
        ({"replicas": []}, "non-empty list"),
        ({"replicas": [{"stages": [[0, 4]], "tp": 0}]}, r"replicas\[0\].tp must be >= 1"),
    ],
)
def test_bad_replica_plans_get_clear_errors(fields: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(fields)


def test_replica_plans_refuse_zero_and_the_wrong_world_size() -> None:
    with pytest.raises(NotSupportedYet, match="Plan.zero=1 with Plan.replicas"):
        Plan(zero=1, replicas=(_replica((0, 4)),))
    with pytest.raises(NotSupportedYet, match=r"replicas\[1\] has tp=2 and 2 pipeline stages"):
        Plan(replicas=(_replica((0, 4)), Replica(((0, 2), (2, 4)), tp=2)), pipeline={"microbatches": 2})
    plan = Plan(replicas=(_replica((0, 4)), _replica((0, 2), (2, 4))), pipeline={"microbatches": 2})
    with pytest.raises(PlanError, match=r"need 3 ranks \(depths 1\+2\) but the job has 4"):
        plan.resolve(4)
    assert plan.resolve(3).dp == 2 and plan.shares() == (1, 1) and plan.pipelined
    assert Plan.from_yaml(plan.to_yaml()) == plan
    tp = Plan(replicas=(_replica((0, 4)), Replica(((0, 4),), share=2, tp=4))).resolve(5)
    assert tp.replica_ranks(1) == [1, 2, 3, 4] and tp.coords(3).tp == 2 and tp.coords(3).dp == 1
    assert [tp.rank_at(tp.coords(r)) for r in range(5)] == list(range(5))
    with pytest.raises(PlanError, match=r"need 5 ranks \(depths 1\+1x tp4\) but the job has 4"):
        tp.resolve(4)
    assert Plan.from_yaml(tp.to_yaml()) == tp


def test_layer_sync_buckets_stay_small_and_keep_order() -> None:
    import torch

    from tessera.parallel import replicas

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 4, 10, 1, 1)]
    old = replicas.BUCKET_BYTES
    replicas.BUCKET_BYTES = 32  # eight fp32 numbers
    try:
        buckets = replicas._buckets(params)
    finally:
        replicas.BUCKET_BYTES = old
    assert [[p.numel() for p in b] for b in buckets] == [[4, 4], [10], [1, 1]]  # one too big stands alone
    assert [p for b in buckets for p in b] == params
