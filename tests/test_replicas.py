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
    ]
    results = check_cases(3, [(name, plan.to_dict(), kind, clip) for name, plan, kind, clip in cases], 16, steps=2)
    assert results["whole_and_two_stages_compiled"]["compiled_graphs"] > 0, "the compiled replica ran eager"


def checkpoint_worker(root: str) -> dict:
    """Train one step with replicas of depth 1 and 2 and save; load under DDP on the same 3 ranks."""
    from parity import TokenData, build_model, loss_fn, make_optimizer

    import tessera
    from tessera.checkpoint import load_checkpoint, save_checkpoint

    def boosted(plan: Plan):
        booster = tessera.Booster(plan)
        model = build_model("llama_tied:4")  # the same initial weights everywhere: only loading can add the step
        model, opt = booster.boost(model, make_optimizer(model.parameters()))
        return booster, model, opt

    plan = Plan(replicas=(_replica((0, 1), (1, 4)), _replica((0, 4), share=2)), pipeline={"microbatches": 2})
    booster, model, opt = boosted(plan)
    batch = next(iter(booster.dataloader(TokenData(), global_batch_size=12)))
    booster.execute_pipeline(batch, model, loss_fn, opt)
    opt.step()
    saved = booster.full_state_dict(model)
    path = save_checkpoint(root, 1, model, opt, {"step": 1}, keep=1, meta={})
    other_booster, other, other_opt = boosted(tessera.DDP())
    load_checkpoint(path, other, other_opt)
    moments = {n: other_opt.state[p]["exp_avg"].clone() for n, p in other.module.named_parameters()}
    return {"saved": saved, "loaded": other_booster.full_state_dict(other), "moments": moments}


def test_checkpoint_saved_under_replicas_loads_under_ddp(tmp_path) -> None:
    import torch

    from tessera.testing import run_ranks

    results = run_ranks(checkpoint_worker, 3, str(tmp_path))
    for result in results:
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
    ],
)
def test_bad_replica_plans_get_clear_errors(fields: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(fields)


def test_replica_plans_refuse_zero_and_the_wrong_world_size() -> None:
    with pytest.raises(NotSupportedYet, match="Plan.zero=1 with Plan.replicas"):
        Plan(zero=1, replicas=(_replica((0, 4)),))
    plan = Plan(replicas=(_replica((0, 4)), _replica((0, 2), (2, 4))), pipeline={"microbatches": 2})
    with pytest.raises(PlanError, match=r"need 3 ranks \(depths 1\+2\) but the job has 4"):
        plan.resolve(4)
    assert plan.resolve(3).dp == 2 and plan.shares() == (1, 1) and plan.pipelined
    assert Plan.from_yaml(plan.to_yaml()) == plan


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
