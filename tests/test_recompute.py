"""Recompute really recomputes: each recomputed block's submodules run again during backward."""

from __future__ import annotations

import pytest
import torch

from tessera.errors import PlanError
from tessera.models import Llama, LlamaConfig
from tessera.parallel.data_parallel import repeated_blocks
from tessera.parallel.recompute import apply_recompute

RUNS = [("none", [1, 1, 1, 1]), ("full", [2, 2, 2, 2]), ("selective", [2, 1, 2, 1]), ("ops", [2, 2, 2, 2])]


@pytest.mark.parametrize("mode,expected", RUNS)
def test_blocks_run_again_in_backward(mode: str, expected: list[int]) -> None:
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16))
    calls = [0] * 4
    for i, block in enumerate(model.layers):
        # a pre-hook: recompute stops early (once every saved tensor is back), before post-hooks would run
        block.feed_forward.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    names_before = [n for n, _ in model.named_parameters()]
    apply_recompute(repeated_blocks(model), mode)
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    assert calls == expected
    assert [n for n, _ in model.named_parameters()] == names_before  # checkpoints keep their keys


def test_recompute_without_blocks_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match="no transformer blocks"):
        apply_recompute([], "full")


def _forward_live_bytes(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes the forward leaves allocated (what it keeps for backward, and its output), from the CPU
    allocator's own events as torch's profiler records them, and the output."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(x)
    return sum(e.self_cpu_memory_usage for e in prof.key_averages()), out


def _backward_ops(loss: torch.Tensor) -> dict[str, int]:
    """How many times each aten op runs in ``loss.backward()``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    with Count() as count:
        loss.backward()
    return count.ops


def test_op_level_recompute_keeps_the_matmuls_and_recomputes_the_rest() -> None:
    """recompute="ops": the backward runs no matmul or attention again (their outputs were kept) but does
    recompute the element-wise work (norms, SiLU); the forward keeps less than without recompute and more
    than full recompute (allocator events); the gradients are the same."""
    import copy

    torch.manual_seed(0)
    base = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176,
                             max_seq_len=128))  # fmt: skip
    x = torch.randint(0, 64, (4, 128), generator=torch.Generator().manual_seed(1))
    kept, ops, grads = {}, {}, {}
    for mode in ("none", "ops", "full"):
        model = copy.deepcopy(base)
        apply_recompute(repeated_blocks(model), mode)
        kept[mode], out = _forward_live_bytes(model, x)
        ops[mode] = _backward_ops(out.sum())
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    matmuls = ("aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert all(ops["ops"].get(op, 0) == ops["none"].get(op, 0) for op in matmuls), ops["ops"]
    assert ops["full"]["aten.mm.default"] > ops["none"]["aten.mm.default"]  # (full recomputes them)
    assert ops["ops"].get("aten.rsqrt.default", 0) > ops["none"].get("aten.rsqrt.default", 0), ops["ops"]
    assert ops["ops"].get("aten.silu.default", 0) > ops["none"].get("aten.silu.default", 0), ops["ops"]
    assert kept["full"] < kept["ops"] < 0.75 * kept["none"], kept
    for mode in ("ops", "full"):
        for name, grad in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], grad, rtol=1e-5, atol=1e-6)
