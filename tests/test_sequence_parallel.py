"""Hybrid-issue acceptance 3 and the sp part of 6: Ulysses attention equals full attention, and
Ulysses training of the reference Llama and the Hugging Face models equals single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import GLOBAL_BATCH_DEFAULT, check_cases

import tessera
from tessera.testing import run_ranks


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


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa-fewer-kv-than-ranks"])
def test_ulysses_attention_equals_full_attention(heads: int, kv_heads: int) -> None:
    for rank, result in enumerate(run_ranks(ulysses_worker, 2, heads, kv_heads)):
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


def test_heads_not_dividing_sp_is_a_clear_error() -> None:
    assert "3 attention heads do not divide by sp=2" in run_ranks(heads_not_dividing_worker, 2)[0]


KINDS = ("llama", "hf_llama", "hf_qwen2")


def sp_plan(**fields) -> dict:
    return tessera.Plan(sp=2, sp_mode="all_to_all", **fields).to_dict()


def test_ulysses_sp2_training_equals_single_process() -> None:
    """Acceptance 6, sp all_to_all, for the reference Llama and each Hugging Face family with a policy."""
    check_cases(2, [(f"{kind} sp2", sp_plan(), kind, None) for kind in KINDS], GLOBAL_BATCH_DEFAULT, 3)


def test_ulysses_with_dp_and_zero_equals_single_process() -> None:
    cases = [(f"{kind} dp2xsp2 zero3", sp_plan(zero=3), kind, None) for kind in KINDS]
    cases += [
        ("llama dp2xsp2 zero1", sp_plan(zero=1), "llama", None),
        ("llama dp2xsp2 zero2 shares 3:1", sp_plan(zero=2, dp_shares=(3, 1)), "llama", None),
    ]
    check_cases(4, cases, GLOBAL_BATCH_DEFAULT, 3)


def test_split_gather_is_refused_until_it_lands() -> None:
    with pytest.raises(tessera.NotSupportedYet, match="split/gather"):
        tessera.Plan(sp=2, sp_mode="split_gather").check_supported()
