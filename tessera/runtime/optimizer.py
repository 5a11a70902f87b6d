"""The user's optimizer, rebuilt for the laid-out model: same class and param groups on the new
parameters (FSDP and tp replace them; a pipeline rank keeps only its stages'), sharded over the
gradient group under ZeRO-1, wrapped in a :class:`~tessera.optim.wrapper.BoostedOptimizer`."""

from __future__ import annotations

import torch
from torch import nn

from tessera.models.hf_experts import expert_modules
from tessera.optim.wrapper import BoostedOptimizer, optimizer_factory, rebuild_optimizer
from tessera.parallel import data_parallel
from tessera.parallel.experts import expert_weights, uneven_expert_groups
from tessera.parallel.zero1 import ShardedOptimizer
from tessera.runtime.engine import Context, Engine


def boost_optimizer(
    optimizer: torch.optim.Optimizer, wrapped: nn.Module, names: dict[int, list[str]], ctx: Context, engine: Engine
) -> BoostedOptimizer:
    """``optimizer`` over ``wrapped``'s parameters; ``names``: every name of each original parameter, by id."""
    current = dict(data_parallel.unwrap(wrapped).named_parameters())
    groups = rebuild_optimizer(optimizer, lambda p: next((current[n] for n in names[id(p)] if n in current), None))
    build = optimizer_factory(optimizer)
    if ctx.plan.zero == 1:
        experts: set[int] = set()
        if ctx.plan.ep > 1:  # each ep rank holds its own experts: spread over the ranks holding the same ones
            experts = {id(p) for p in expert_weights(expert_modules(data_parallel.unwrap(wrapped)))}
            replicas = ctx.meshes.group("dp_rep")
        holders = (lambda p: replicas if id(p) in experts else None) if experts else (lambda p: None)
        split = uneven_expert_groups(data_parallel.unwrap(wrapped))
        inner = ShardedOptimizer(
            groups, build, engine.grad_group(), offload=ctx.plan.offload, holders=holders, split=split
        )
    else:
        inner = build(groups)
    return BoostedOptimizer(inner, list(wrapped.parameters()), ctx.scaler)
