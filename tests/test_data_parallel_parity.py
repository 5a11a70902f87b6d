"""Acceptance 1, 4, 5, 7: every data-parallel layout reproduces single-process training.

Loss every step (mean over the global batch), the global gradient norm, and the
full parameters after 3 AdamW steps equal plain PyTorch on one process
(fp32: rtol 1e-5, atol 1e-5).
"""

from __future__ import annotations

import functools

import pytest
from parity import assert_same_training, reference_run, tessera_run

import tessera
from tessera.testing import run_ranks

STEPS = 3
GLOBAL_BATCH = 8

PRESETS = {
    "ddp": tessera.DDP(),
    "zero1": tessera.ZeRO(stage=1),
    "zero2": tessera.ZeRO(stage=2),
    "zero3": tessera.ZeRO(stage=3),
    "zero3_offload": tessera.ZeRO(stage=3, offload=True),
}


@functools.cache
def reference(kind: str, max_norm: float | None = None) -> dict:
    return reference_run(kind, GLOBAL_BATCH, STEPS, max_norm=max_norm)


def run_parity(kind: str, plan: tessera.Plan, world: int, max_norm: float | None = None) -> None:
    results = run_ranks(tessera_run, world, plan.to_dict(), kind, GLOBAL_BATCH, STEPS, 1e-3, max_norm)
    assert_same_training(results[0], reference(kind, max_norm))
    # Every rank reports the same global loss.
    for r in results[1:]:
        assert r["losses"] == results[0]["losses"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_llama_matches_single_process(preset: str, world: int) -> None:
    run_parity("llama", PRESETS[preset], world)


@pytest.mark.parametrize("preset", ["zero1", "zero2"])
def test_offload_zero12_matches_single_process(preset: str) -> None:
    plan = tessera.ZeRO(stage=PRESETS[preset].zero, offload=True)
    run_parity("llama", plan, 2)


def test_tied_embeddings_zero3() -> None:
    run_parity("llama_tied", tessera.ZeRO(stage=3), 2)


@pytest.mark.parametrize("world,shares", [(2, (3, 1)), (4, (1, 2, 1, 4))], ids=["shares3-1", "shares1-2-1-4"])
@pytest.mark.parametrize("preset", ["ddp", "zero1", "zero2", "zero3"])
def test_uneven_shares_match_single_process(preset: str, world: int, shares: tuple[int, ...]) -> None:
    plan = tessera.Plan.from_dict({**PRESETS[preset].to_dict(), "dp_shares": list(shares)})
    run_parity("llama", plan, world)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_hf_gpt2_matches_single_process(preset: str, world: int) -> None:
    run_parity("gpt2", PRESETS[preset], world)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_hf_llama_matches_single_process(preset: str) -> None:
    run_parity("hf_llama", PRESETS[preset], 2)


@pytest.mark.parametrize("world,shares", [(2, (3, 1)), (4, (1, 2, 1, 4))], ids=["shares3-1", "shares1-2-1-4"])
def test_hf_gpt2_uneven_shares(world: int, shares: tuple[int, ...]) -> None:
    run_parity("gpt2", tessera.ZeRO(stage=3, dp_shares=shares), world)


@pytest.mark.parametrize("preset", ["ddp", "zero1", "zero2", "zero3"])
def test_clip_grad_norm_is_the_global_norm(preset: str) -> None:
    max_norm = 0.05
    assert min(reference("llama", max_norm)["norms"]) > max_norm, "the test must really clip"
    run_parity("llama", PRESETS[preset], 2, max_norm=max_norm)


@pytest.mark.parametrize(
    "plan,kind",
    [
        (tessera.Plan(zero=3, recompute="full"), "llama"),
        (tessera.Plan(zero=0, recompute="selective"), "gpt2"),
        (tessera.Plan(zero=2, recompute="full"), "hf_llama"),
    ],
    ids=["zero3-full-llama", "ddp-selective-gpt2", "zero2-full-hf-llama"],
)
def test_recompute_changes_memory_not_results(plan: tessera.Plan, kind: str) -> None:
    run_parity(kind, plan, 2)
