"""The whole model on every rank: data parallel or ZeRO, with tensor or sequence parallelism."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.runtime.engine import Engine, LossFn
from tessera.runtime.microbatches import accumulate
from tessera.runtime.parallelize import enable_ulysses, parallelize


class FlatEngine(Engine):
    def wrap(self, model: nn.Module, names: list[list[str]]) -> nn.Module:
        ctx, plan = self.ctx, self.ctx.plan
        if plan.tp > 1:
            ctx.require_policy("tensor parallelism").check_tp(model, plan.tp)  # before any group is created
        if plan.ulysses_size > 1:
            enable_ulysses(model, ctx.meshes, ctx.require_policy("Ulysses sequence parallelism"))
        return parallelize(model, plan, ctx.meshes, ctx.policy, ctx.hooks, ctx.device)

    def forward_backward(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        return accumulate(self.ctx, inputs, target, model, loss_fn)
