"""Hybrid-issue acceptance 4-8 (pipeline parts): every schedule, uneven stages, pp composed with
tp and ZeRO, clipping and checkpoints — all equal single-process training.

Each case trains 2 AdamW steps on a global batch of 12 (divisible by 4 and 6 micro-batches) and
compares the loss of every step, the global gradient norm, every first-step gradient and the
parameters after the last step with plain PyTorch (fp32: rtol 1e-5, atol 1e-5). Cases run in
a few process groups (one per world size) because spawning ranks costs more than a case.
"""

from __future__ import annotations

import parity
import pytest
import torch
from torch import nn

import tessera
from tessera.errors import PlanError
from tessera.testing import run_ranks

STEPS = 2
BATCH = 12
SINGLE = ("gpipe", "1f1b")
INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")
ALL_SCHEDULES = (*SINGLE, *INTERLEAVED, "looped_bfs", "zbv_zero_bubble", "dualpipev")


def pp_plan(pp: int, schedule: str, microbatches: int, stages=None, **fields) -> dict:
    pipeline = {"schedule": schedule, "microbatches": microbatches, "stages": stages}
    return tessera.Plan(pp=pp, pipeline=pipeline, **fields).to_dict()


def check_cases(world: int, cases: list[tuple[str, dict, str, float | None]]) -> None:
    parity.check_cases(world, cases, BATCH, STEPS)


def test_every_schedule_on_pp2_even_and_uneven_stages_equals_single_process() -> None:
    """Acceptance 4 and 5 on pp=2: even stages and 5:3 layers, 4 and 6 micro-batches."""
    cases = []
    for mb in (4, 6):
        for schedule in ALL_SCHEDULES:
            cases.append((f"{schedule}/mb{mb}", pp_plan(2, schedule, mb), "llama:8", None))
        for schedule in (*SINGLE, *INTERLEAVED):
            cases.append((f"{schedule}/5:3/mb{mb}", pp_plan(2, schedule, mb, [[0, 5], [5, 8]]), "llama:8", None))
        uneven_v = [[0, 3], [3, 4], [4, 6], [6, 8]]  # two stages per rank, 3:1:2:2 layers
        for schedule in (*INTERLEAVED, "zbv_zero_bubble", "dualpipev"):
            cases.append((f"{schedule}/3:1:2:2/mb{mb}", pp_plan(2, schedule, mb, uneven_v), "llama:8", None))
    check_cases(2, cases)


def test_every_schedule_on_pp4_even_and_uneven_stages_equals_single_process() -> None:
    """Acceptance 4 and 5 on pp=4: even stages and 1:3:2:2 layers, 4 and 6 micro-batches."""
    cases = []
    for mb in (4, 6):
        for schedule in (*SINGLE, *INTERLEAVED, "looped_bfs", "zbv_zero_bubble"):
            cases.append((f"{schedule}/mb{mb}", pp_plan(4, schedule, mb), "llama:8", None))
        for schedule in (*SINGLE, *INTERLEAVED):
            stages = [[0, 1], [1, 4], [4, 6], [6, 8]]
            cases.append((f"{schedule}/1:3:2:2/mb{mb}", pp_plan(4, schedule, mb, stages), "llama:8", None))
    cases.append(("dualpipev/mb12", pp_plan(4, "dualpipev", 12), "llama:8", None))  # needs mb >= 8 stages
    check_cases(4, cases)


def test_pipeline_composes_with_tp_and_zero_for_every_model() -> None:
    """Acceptance 6 (pp parts) and 7: pp2, tp2×pp2, dp2×pp2 with ZeRO, pp2×sp2 (Ulysses), clipping
    under tp2×pp2."""
    cases = []
    for kind in ("llama:4", "hf_llama:4", "hf_qwen2:4"):
        cases.append((f"{kind} tp2xpp2", pp_plan(2, "1f1b", 2, tp=2), kind, None))
        cases.append((f"{kind} dp2xpp2 zero1", pp_plan(2, "1f1b", 2, zero=1), kind, None))
    cases.append(("gpt2:4 dp2xpp2 zero1", pp_plan(2, "1f1b", 2, zero=1), "gpt2:4", None))
    cases.append(("gpt2:4 tp2xpp2 (tied copies, vocab-sharded)", pp_plan(2, "1f1b", 2, tp=2), "gpt2:4", None))
    cases.append(("llama_tied:4 dp2xpp2 zero3 clipped", pp_plan(2, "1f1b", 2, zero=3), "llama_tied:4", 0.05))
    for zero in (0, 2, 3):
        cases.append((f"dp2xpp2 zero{zero} interleaved", pp_plan(2, "interleaved_1f1b", 2, zero=zero), "llama:4", None))
    cases += [
        (f"{kind} pp2xsp2 ulysses", pp_plan(2, "1f1b", 2, sp=2), kind, None)
        for kind in ("llama:4", "hf_qwen2:4", "gpt2:4")
    ]
    cases.append(("tp2xpp2 clipped", pp_plan(2, "1f1b", 2, tp=2), "llama:4", 0.05))
    cases.append(("tp2xpp2 loss_parallel", pp_plan(2, "1f1b", 2, tp=2, loss_parallel=True), "llama:4", None))
    check_cases(4, cases)


def test_pipeline_on_hugging_face_and_tied_models_pp2() -> None:
    """Acceptance 6, pp2 on each Hugging Face family with a policy. GPT-2 and the tied Llama share
    the embedding with the head: the first and last stages hold copies whose gradients are summed
    (looped schedules) or meet on one rank (V schedules)."""
    cases = [
        (f"{kind} pp2", pp_plan(2, "1f1b", 4, [[0, 3], [3, 4]]), kind, None)
        for kind in ("hf_llama:4", "hf_qwen2:4", "gpt2:4", "llama_tied:4")
    ]
    cases += [(f"{kind} pp2 zbv", pp_plan(2, "zbv_zero_bubble", 4), kind, None) for kind in ("gpt2:4", "llama_tied:4")]
    check_cases(2, cases)


def test_dp_tp_pp_on_8_ranks_equals_single_process() -> None:
    """The one 8-rank test: dp2 × tp2 × pp2, with ZeRO-1 and with ZeRO-3 (GPT-2: tied copies,
    strided q/k/v and FSDP at once), and dp2 × sp2 × pp2 (Ulysses inside pipeline stages)."""
    cases = [
        ("llama:4 dp2xtp2xpp2 zero1", pp_plan(2, "1f1b", 2, tp=2, zero=1), "llama:4", None),
        ("gpt2:4 dp2xtp2xpp2 zero3 interleaved", pp_plan(2, "interleaved_1f1b", 2, tp=2, zero=3), "gpt2:4", None),
        ("hf_llama:4 dp2xsp2xpp2 zero2", pp_plan(2, "1f1b", 2, sp=2, zero=2), "hf_llama:4", None),
    ]
    check_cases(8, cases)


def checkpoint_worker(root: str) -> dict:
    """Train one step under tp2×pp2 and save; load under DDP and under ZeRO-3 on the same 4 ranks."""
    from parity import TokenData, build_model, loss_fn, make_optimizer

    from tessera.checkpoint import load_checkpoint, save_checkpoint

    def boosted(plan: tessera.Plan):
        booster = tessera.Booster(plan)
        model = build_model("llama:4")  # the same initial weights everywhere: only loading can add the step
        model, opt = booster.boost(model, make_optimizer(model.parameters()))
        return booster, model, opt

    booster, model, opt = boosted(tessera.Hybrid(tp=2, pp=2, microbatches=2, schedule="1f1b"))
    batch = next(iter(booster.dataloader(TokenData(), global_batch_size=4)))
    booster.execute_pipeline(batch, model, loss_fn, opt)
    opt.step()
    saved = booster.full_state_dict(model)
    path = save_checkpoint(root, 1, model, opt, {"step": 1}, keep=1, meta={})
    loaded = {}
    for name, plan in (("ddp", tessera.DDP()), ("zero3", tessera.ZeRO(stage=3))):
        other_booster, other, other_opt = boosted(plan)
        load_checkpoint(path, other, other_opt)
        loaded[name] = other_booster.full_state_dict(other)
    return {"saved": saved, "loaded": loaded}


def test_checkpoint_saved_under_tp2_pp2_loads_under_ddp_and_zero3(tmp_path) -> None:
    """Acceptance 8."""
    for result in run_ranks(checkpoint_worker, 4, str(tmp_path)):
        for layout, state in result["loaded"].items():
            assert state.keys() == result["saved"].keys()
            for k, v in result["saved"].items():
                assert torch.equal(state[k], v), f"{layout}: {k} differs from the tp2xpp2 checkpoint"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"pp": 2, "pipeline": {"schedule": "1f1b", "microbatches": 1}}, "at least as many micro-batches"),
        (
            {"pp": 2, "pipeline": {"schedule": "gpipe", "stages": [[0, 1], [1, 2], [2, 3], [3, 4]]}},
            "one stage per rank",
        ),
        (
            {"pp": 2, "pipeline": {"schedule": "zbv_zero_bubble", "microbatches": 4, "stages": [[0, 1], [1, 2]]}},
            "V shape",
        ),
        ({"pp": 2, "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 5}}, "not divisible by 2"),
        ({"pp": 2, "pipeline": {"schedule": "gpipe", "stages": [[0, 2]]}}, "multiple of pp"),
    ],
)
def test_bad_pipeline_plans_are_refused_before_any_group(fields: dict, match: str) -> None:
    """Acceptance 9, the schedule-dependent checks (the plain stage-range ones are in test_plan)."""
    with pytest.raises(PlanError, match=match):
        tessera.Plan.from_dict(fields)


def test_more_stages_than_layers_is_refused() -> None:
    spec = tessera.Plan(pp=4, pipeline={"schedule": "interleaved_1f1b", "microbatches": 4}).pipeline
    with pytest.raises(PlanError, match="only 4 layers"):
        spec.stage_ranges(4, 4)


def refusals_worker() -> dict:
    """What a user sees for models and batches the pipeline cannot take."""
    from parity import build_model, loss_fn, make_optimizer

    def error(action) -> str:
        try:
            action()
        except PlanError as exc:
            return str(exc)
        return "no error"

    plan = tessera.Hybrid(pp=2, microbatches=2, schedule="gpipe")
    out = {
        "no policy": error(lambda: tessera.Booster(plan).boost(nn.Sequential(nn.Linear(2, 2)))),
        "tie split": error(
            lambda: tessera.Booster(tessera.Hybrid(pp=2, zero=3, microbatches=4, schedule="zbv_zero_bubble")).boost(
                build_model("llama_tied:4")
            )
        ),
    }
    booster = tessera.Booster(plan)
    model = build_model("llama")
    model, opt = booster.boost(model, make_optimizer(model.parameters()))
    x = torch.zeros(4, 16, dtype=torch.long)
    out["call"] = error(lambda: model(x))
    out["batch"] = error(lambda: booster.execute_pipeline({"tokens": x}, model, loss_fn, opt))
    out["odd"] = error(lambda: booster.execute_pipeline((x[:3], x[:3]), model, loss_fn, opt))
    return out


def test_models_and_batches_the_pipeline_cannot_take_get_clear_errors() -> None:
    got = run_ranks(refusals_worker, 2)[0]
    assert "no policy for Sequential" in got["no policy"] and "Plan.pp=1" in got["no policy"]
    assert "would drift apart" in got["tie split"] and "looped schedule" in got["tie split"]
    assert "execute_pipeline" in got["call"]
    assert "'y'/'labels'" in got["batch"] and "tokens" in got["batch"]
    assert "3 samples" in got["odd"] and "microbatches=2" in got["odd"]
