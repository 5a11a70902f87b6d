"""Hybrid-issue acceptance 3 and the sp part of 6: Ulysses attention equals full attention, and
Ulysses and Megatron split/gather training of the reference Llama and the Hugging Face models
equal single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import GLOBAL_BATCH_DEFAULT, check_cases, run_shared

import tessera


def ulysses_worker(heads: int, kv_heads: int) -> dict:
    import torch.distributed as dist

    from tessera.parallel.sequence import ulysses_attention

    torch.manual_seed(0)
    b, s, d = 2, 16, 8
    q, k, v = (torch.randn(b, n, s, d) for n in (heads, kv_heads, kv_heads))
    probe = torch.randn(b, heads, s, d)
    rank, p = dist.get_rank(), dist.get_world_size()
    lo, hi = rank * s // p, (rank + 1) * s // p
    # Reference: full sequence, grouped-query attention by repeating kv heads.
    qf, kf, vf = (t.clone().requires_grad_(True) for t in (q, k, v))
    r = heads // kv_heads
    ref = F.scaled_dot_product_attention(qf, kf.repeat_interleave(r, 1), vf.repeat_interleave(r, 1), is_causal=True)
    (ref * probe).sum().backward()
    # Ulysses: this rank's sequence slice only.
    ql, kl, vl = (t[:, :, lo:hi].clone().requires_grad_(True) for t in (q, k, v))
    out = ulysses_attention(ql, kl, vl, dist.group.WORLD)
    (out * probe[:, :, lo:hi]).sum().backward()
    return {
        "out": (out.detach(), ref.detach()[:, :, lo:hi]),
        "q_grad": (ql.grad, qf.grad[:, :, lo:hi]),
        "k_grad": (kl.grad, kf.grad[:, :, lo:hi]),
        "v_grad": (vl.grad, vf.grad[:, :, lo:hi]),
    }


HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa-fewer-kv-than-ranks": (4, 1)}


@pytest.mark.parametrize("case", list(HEADS))
def test_ulysses_attention_equals_full_attention(case: str, two_ranks: dict) -> None:
    for rank, result in enumerate(two_ranks[f"ulysses-{case}"]):
        for name, (got, want) in result.items():
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}"
            )


def heads_not_dividing_worker() -> str:
    import torch.distributed as dist

    from tessera.errors import PlanError
    from tessera.parallel.sequence import ulysses_attention

    x = torch.randn(1, 3, 4, 8)
    try:
        ulysses_attention(x, x, x, dist.group.WORLD)
    except PlanError as exc:
        return str(exc)
    return "no error"


def test_heads_not_dividing_sp_is_a_clear_error(two_ranks: dict) -> None:
    assert "3 attention heads do not divide by sp=2" in two_ranks["heads-not-dividing"][0]


KINDS = ("llama", "hf_llama", "hf_qwen2")


def sp_plan(**fields) -> dict:
    return tessera.Plan(sp=2, sp_mode="all_to_all", **fields).to_dict()


SPLIT_GATHER = tessera.Hybrid(tp=2, sp="split_gather")


def test_sp2_training_equals_single_process() -> None:
    """Acceptance 6: sp all_to_all, and sp split_gather with tp2, for the reference Llama and each
    Hugging Face family with a policy."""
    cases = [(f"{kind} sp2", sp_plan(), kind, None) for kind in (*KINDS, "gpt2")]
    cases += [(f"{kind} tp2 split_gather", SPLIT_GATHER.to_dict(), kind, None) for kind in (*KINDS, "gpt2")]
    check_cases(2, cases, GLOBAL_BATCH_DEFAULT, 3)


def test_ulysses_with_dp_and_zero_equals_single_process() -> None:
    cases = [(f"{kind} dp2xsp2 zero3", sp_plan(zero=3), kind, None) for kind in (*KINDS, "gpt2")]
    cases += [
        (
            f"{kind} dp2x(tp2 split_gather) zero{z}",
            tessera.Hybrid(tp=2, sp="split_gather", zero=z).to_dict(),
            kind,
            None,
        )
        for kind in ("llama", "hf_qwen2", "gpt2")
        for z in (1, 3)
    ]
    cases += [
        ("llama dp2xsp2 zero1", sp_plan(zero=1), "llama", None),
        ("llama dp2xsp2 zero2 shares 3:1", sp_plan(zero=2, dp_shares=(3, 1)), "llama", None),
    ]
    check_cases(4, cases, GLOBAL_BATCH_DEFAULT, 3)


def split_gather_shapes_worker(kind: str) -> dict:
    """The sequence length each norm actually sees under split/gather (parity alone cannot show it)."""
    from parity import SEQ, build_model

    from tessera.distributed import local

    model = build_model(kind)
    norms = {
        "llama": lambda m: (m.layers[0].attention_norm, m.norm),
        "hf_llama": lambda m: (m.model.layers[0].input_layernorm, m.model.norm),
        "gpt2": lambda m: (m.transformer.h[0].ln_1, m.transformer.ln_f),
    }[kind](model)
    seen = []
    for norm in norms:
        norm.register_forward_hook(lambda mod, args, out: seen.append(local(args[0]).shape[1]))
    booster = tessera.Booster(SPLIT_GATHER)
    model, _ = booster.boost(model)
    logits = model(torch.zeros(2, SEQ, dtype=torch.long))
    return {"norm_seq": seen, "logits_seq": local(getattr(logits, "logits", logits)).shape[1]}


SHAPE_KINDS = ("llama", "hf_llama", "gpt2")


@pytest.mark.parametrize("kind", SHAPE_KINDS)
def test_split_gather_norms_see_a_sequence_shard(kind: str, two_ranks: dict) -> None:
    from parity import SEQ

    got = two_ranks[f"shapes-{kind}"][0]
    assert got["norm_seq"] == [SEQ // 2, SEQ // 2], got  # block norm and final norm: half the tokens each
    assert got["logits_seq"] == SEQ  # the head gathers the sequence back


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """The small 2-rank checks of this file, in one launch (spawning ranks costs more than a check)."""
    calls = {f"ulysses-{case}": (ulysses_worker, heads) for case, heads in HEADS.items()}
    calls["heads-not-dividing"] = (heads_not_dividing_worker, ())
    calls.update({f"shapes-{kind}": (split_gather_shapes_worker, (kind,)) for kind in SHAPE_KINDS})
    return run_shared(2, calls)
