"""Acceptance 8 and the Plan contract: validation, round-trips, refusals."""

from __future__ import annotations

import pytest

import tessera
from tessera import Plan, PlanError
from tessera.data.sharding import ShareBatchSampler, split_batch


def test_presets_return_plans() -> None:
    assert isinstance(tessera.DDP(), Plan) and tessera.DDP().zero == 0
    for stage in (1, 2, 3):
        assert tessera.ZeRO(stage=stage).zero == stage
    assert tessera.ZeRO(stage=3, offload=True, precision="bf16").offload


@pytest.mark.parametrize(
    "plan",
    [
        Plan(),
        Plan(zero=3, offload=True, precision="fp16", dp_shares=(3, 1)),
        Plan(dp=2, zero=1, rank_devices=("A100-80GB", "T4")),
        Plan(tp=2, pp=2, pipeline=tessera.PipelineSpec(stages=((0, 5), (5, 8)), microbatches=4, schedule="gpipe")),
    ],
)
def test_json_and_yaml_round_trip(plan: Plan, tmp_path) -> None:
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_yaml(plan.to_yaml()) == plan
    for name in ("plan.json", "plan.yaml"):
        plan.save(tmp_path / name)
        assert Plan.load(tmp_path / name) == plan
    hash(plan)  # frozen and hashable


def test_plan_is_frozen() -> None:
    with pytest.raises(AttributeError):
        Plan().zero = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: Plan(zero=4), "zero"),
        (lambda: Plan(zero=-1), "zero"),
        (lambda: tessera.ZeRO(stage=0), "stage"),
        (lambda: Plan(precision="fp4"), "precision"),
        (lambda: Plan(dp_shares=(3, 0)), "dp_shares[1]"),
        (lambda: Plan(dp_shares=(2, -1)), "dp_shares[1]"),
        (lambda: Plan(dp=2, dp_shares=(1, 1, 1)), "dp_shares"),
        (lambda: Plan(dp_shares=(3, 1)).resolve(4), "dp_shares"),
        (lambda: Plan(dp=3).resolve(4), "dp×tp×pp×sp"),
        (lambda: Plan(tp="2"), "tp"),
        (lambda: Plan(device="tpu"), "device"),
        (lambda: Plan(offload=True), "offload"),
        (lambda: Plan.from_dict({"zeroo": 2}), "zeroo"),
        (lambda: Plan.from_dict({"pipeline": {"schedul": "gpipe"}}), "schedul"),
        (lambda: Plan(pipeline=tessera.PipelineSpec(schedule="zigzag")), "pipeline.schedule"),
        (lambda: Plan(pipeline=tessera.PipelineSpec(stages=((3, 1),))), "pipeline.stages[0]"),
        (lambda: Plan.from_json("{not json"), "JSON"),
        (lambda: tessera.PipelineSpec(stages=((0, 5), (4, 8))), "overlap"),
        (lambda: tessera.PipelineSpec(stages=((0, 5), (6, 8))), "gap"),
        (lambda: tessera.PipelineSpec(stages=((1, 5), (5, 8))), "start at layer 0"),
        (lambda: Plan(pp=2, pipeline=tessera.PipelineSpec(stages=((0, 2), (2, 4), (4, 8)))), "multiple of pp"),
        (lambda: tessera.PipelineSpec(stages=((0, 1), (1, 2), (2, 3))).check_layers(2), "only 2 layers"),
        (lambda: tessera.PipelineSpec(stages=((0, 5), (5, 8))).check_layers(10), "must end at 10"),
    ],
)
def test_bad_plans_name_the_field(make, field: str) -> None:
    with pytest.raises(PlanError) as info:
        make()
    assert field in str(info.value), str(info.value)


def test_unknown_key_suggests_the_nearest() -> None:
    with pytest.raises(PlanError, match='did you mean "zero"'):
        Plan.from_dict({"zeroo": 2})


def test_split_gather_needs_sp_equal_to_tp() -> None:
    with pytest.raises(PlanError, match="must equal Plan.tp=1"):
        Plan(sp=2, sp_mode="split_gather")
    with pytest.raises(PlanError, match="sp='split_gather'"):
        tessera.Hybrid(tp=2, sp="ulysses")
    assert tessera.Hybrid(tp=2, sp="split_gather").resolve(2).dp == 1  # split/gather adds no ranks


def test_layouts_that_do_not_compose_yet_are_refused_not_ignored() -> None:
    with pytest.raises(tessera.NotSupportedYet, match="Plan.sp=2 .all_to_all. together with Plan.tp=2"):
        Plan(tp=2, sp=2).resolve(4)
    with pytest.raises(tessera.NotSupportedYet, match="Plan.pp=2 with split/gather"):
        tessera.Hybrid(pp=2, tp=2, sp="split_gather", microbatches=2).resolve(4)


def test_cuda_requested_without_cuda_is_a_clear_error() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error is for machines without it")
    with pytest.raises(PlanError, match='device="cuda"'):
        tessera.Booster(Plan(device="cuda"))


def test_global_batch_must_split_as_asked() -> None:
    assert split_batch(32, (3, 1)) == [24, 8]
    assert split_batch(8, (1, 2, 1, 4)) == [1, 2, 1, 4]
    with pytest.raises(PlanError, match="global_batch_size=30"):
        split_batch(30, (3, 1))
    with pytest.raises(PlanError, match="smaller than the 4"):
        split_batch(2, (1, 1, 1, 1))
    with pytest.raises(PlanError, match="positive integer"):
        split_batch(0, (1,))
    with pytest.raises(PlanError, match="fewer than one global batch"):
        ShareBatchSampler(10, 16, (1, 1), 0)


def test_sampler_ranks_partition_each_global_batch() -> None:
    shares = (1, 2, 1, 4)
    per_rank = [list(ShareBatchSampler(40, 16, shares, r, seed=3)) for r in range(4)]
    single = list(ShareBatchSampler(40, 16, (1,), 0, seed=3))
    assert len(single) == 2
    for b, whole in enumerate(single):
        assert sum((per_rank[r][b] for r in range(4)), []) == whole
        assert [len(per_rank[r][b]) for r in range(4)] == [2, 4, 2, 8]
