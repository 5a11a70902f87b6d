"""Recompute really recomputes: each recomputed block's submodules run again during backward."""

from __future__ import annotations

import pytest
import torch

from tessera.errors import PlanError
from tessera.models import Llama, LlamaConfig
from tessera.parallel.data_parallel import repeated_blocks
from tessera.parallel.recompute import apply_recompute


@pytest.mark.parametrize("mode,expected", [("none", [1, 1, 1, 1]), ("full", [2, 2, 2, 2]), ("selective", [2, 1, 2, 1])])
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
