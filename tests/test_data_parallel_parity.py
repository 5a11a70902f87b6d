"""Acceptance 1, 4, 5, 7: every data-parallel layout reproduces single-process training.

Loss every step (mean over the global batch), the global gradient norm, every first-step
gradient and the full parameters after 3 AdamW steps equal plain PyTorch on one process
(fp32: rtol 1e-5, atol 1e-5). Cases share one process group per world size and model family
(spawning ranks costs more than a case); a failure lists every case that failed.
"""

from __future__ import annotations

from parity import check_cases, reference_run

import tessera

STEPS = 3
GLOBAL_BATCH = 8

PRESETS = {
    "ddp": tessera.DDP(),
    "zero1": tessera.ZeRO(stage=1),
    "zero2": tessera.ZeRO(stage=2),
    "zero3": tessera.ZeRO(stage=3),
    "zero3_offload": tessera.ZeRO(stage=3, offload=True),
}
CLIP = 0.05  # below every step's true norm: the clipping tests really clip


def case(kind: str, plan: tessera.Plan, label: str, max_norm: float | None = None) -> tuple:
    return (f"{kind} {label}", plan.to_dict(), kind, max_norm)


def with_shares(preset: str, shares: tuple[int, ...]) -> tessera.Plan:
    return tessera.Plan.from_dict({**PRESETS[preset].to_dict(), "dp_shares": list(shares)})


def test_llama_every_layout_on_2_ranks() -> None:
    """Every preset, offloaded ZeRO-1/2, tied embeddings, 3:1 shares, global-norm clipping, recompute."""
    cases = [case("llama", plan, name) for name, plan in PRESETS.items()]
    cases += [case("llama", tessera.ZeRO(stage=z, offload=True), f"zero{z} offload") for z in (1, 2)]
    cases.append(case("llama_tied", tessera.ZeRO(stage=3), "zero3"))
    cases += [case("llama", with_shares(p, (3, 1)), f"{p} shares 3:1") for p in ("ddp", "zero1", "zero2", "zero3")]
    cases += [case("llama", PRESETS[p], f"{p} clipped", CLIP) for p in ("ddp", "zero1", "zero2", "zero3")]
    cases.append(case("llama", tessera.Plan(zero=3, recompute="full"), "zero3 full recompute"))
    cases.append(case("llama", tessera.Plan(recompute="ops"), "ddp op-level recompute"))
    assert min(reference_run("llama", GLOBAL_BATCH, STEPS, max_norm=CLIP)["norms"]) > CLIP, "must really clip"
    check_cases(2, cases, GLOBAL_BATCH, STEPS)


def test_llama_every_layout_on_4_ranks() -> None:
    cases = [case("llama", plan, name) for name, plan in PRESETS.items()]
    shares = (1, 2, 1, 4)
    cases += [case("llama", with_shares(p, shares), f"{p} shares 1:2:1:4") for p in ("ddp", "zero1", "zero2", "zero3")]
    check_cases(4, cases, GLOBAL_BATCH, STEPS)


def test_hugging_face_models_on_2_ranks() -> None:
    """GPT-2 (tied embeddings, Conv1D) and Llama from configs, every preset, shares and recompute (each
    mode)."""
    cases = [case(kind, plan, name) for kind in ("gpt2", "hf_llama") for name, plan in PRESETS.items()]
    cases.append(case("gpt2", tessera.ZeRO(stage=3, dp_shares=(3, 1)), "zero3 shares 3:1"))
    cases.append(case("gpt2", tessera.Plan(zero=0, recompute="selective"), "ddp selective recompute"))
    cases.append(case("hf_llama", tessera.Plan(zero=2, recompute="full"), "zero2 full recompute"))
    cases.append(case("hf_llama", tessera.Plan(zero=3, recompute="ops"), "zero3 op-level recompute"))
    check_cases(2, cases, GLOBAL_BATCH, STEPS)


def test_hf_gpt2_on_4_ranks() -> None:
    cases = [case("gpt2", plan, name) for name, plan in PRESETS.items()]
    cases.append(case("gpt2", tessera.ZeRO(stage=3, dp_shares=(1, 2, 1, 4)), "zero3 shares 1:2:1:4"))
    check_cases(4, cases, GLOBAL_BATCH, STEPS)
