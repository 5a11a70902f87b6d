"""The user's optimizer, rebuilt for the laid-out model: same class and param groups on the new
parameters (FSDP and tp replace them; a pipeline rank keeps only its stages'), sharded over the
gradient group under ZeRO-1, wrapped in a :class:`~tessera.optim.wrapper.BoostedOptimizer` that holds its
part of a checkpoint (the sharded optimizer's or torch's state, uneven experts' made whole)."""

from __future__ import annotations

import torch
from torch import nn

from tessera.checkpoint.parts import Part, TorchOptimizerState
from tessera.errors import PlanError
from tessera.models.hf_experts import expert_modules
from tessera.optim.wrapper import BoostedOptimizer, optimizer_factory, rebuild_optimizer
from tessera.parallel import data_parallel
from tessera.parallel.experts import expert_weights, uneven_expert_groups, uneven_experts_state
from tessera.parallel.zero1 import ShardedOptimizer, ShardedOptimizerState
from tessera.runtime.engine import Context, Engine


def check_optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, list[str]]) -> None:
    """Refuse an optimizer holding parameters the model does not (``names``: the model's, by id)."""
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if foreign:
        raise PlanError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not in the model: "
            "build the optimizer from model.parameters()."
        )


def boost_optimizer(
    optimizer: torch.optim.Optimizer, wrapped: nn.Module, names: dict[int, list[str]], ctx: Context, engine: Engine
) -> BoostedOptimizer:
    """``optimizer`` over ``wrapped``'s parameters; ``names``: every name of each original parameter, by id."""
    current = dict(data_parallel.unwrap(wrapped).named_parameters())
    groups = rebuild_optimizer(optimizer, lambda p: next((current[n] for n in names[id(p)] if n in current), None))
    build = optimizer_factory(optimizer)

    def param_names() -> dict[int, str]:  # as the laid-out model holds its parameters when a checkpoint asks
        return {id(p): name for name, p in data_parallel.unwrap(wrapped).named_parameters()}

    state: Part
    split = uneven_expert_groups(data_parallel.unwrap(wrapped))
    if ctx.plan.zero == 1:
        experts: set[int] = set()
        if ctx.plan.ep > 1:  # each ep rank holds its own experts: spread over the ranks holding the same ones
            experts = {id(p) for p in expert_weights(expert_modules(data_parallel.unwrap(wrapped)))}
            replicas = ctx.meshes.group("dp_rep")
        holders = (lambda p: replicas if id(p) in experts else None) if experts else (lambda p: None)
        inner = ShardedOptimizer(
            groups, build, engine.grad_group(), offload=ctx.plan.offload, holders=holders, split=split
        )
        state = ShardedOptimizerState(inner, param_names)
    else:
        inner = build(groups)
        state = TorchOptimizerState(wrapped, inner)
    if split:  # experts split unevenly: checkpoints hold every rank's rows of their state
        state = uneven_experts_state(state, wrapped, param_names)
    return BoostedOptimizer(inner, list(wrapped.parameters()), ctx.scaler, state)
