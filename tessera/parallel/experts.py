"""Apply the expert-parallel part of a Plan: each MoE layer's experts split over the ``ep`` mesh axis
(the reference Llama's and Hugging Face's stacked experts alike: modules with ``stacked_weights``,
``num_experts``, ``ep_group`` and ``grad_scale``, found by :func:`tessera.models.hf_experts.expert_modules`).

The ep ranks are neighbouring data-parallel ranks: each holds ``experts / ep`` experts of every MoE layer
(its stacked weights become DTensors split on the expert dimension, so checkpoints hold whole layers and
load under any ep) and the tokens routed to an expert travel to its rank and back
(:meth:`tessera.models.moe.MoE.exchange`). Gradients: an expert's gradient on its rank already sums the
contributions of the tokens of every ep rank (the all-to-all's backward brings them), so it is summed over
the ranks that hold the same experts (``dp / ep`` of them: the "dp_rep" axis) and divided by dp, which
makes it the gradient of the data-parallel mean loss; every other parameter is averaged over dp as usual
(DDP leaves the experts to this module).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from tessera.errors import PlanError


def check_expert_parallel(ep: int, experts: Sequence[nn.Module]) -> None:
    """Refuse an ep the model's experts cannot be split by (or a model without any)."""
    if ep == 1:
        return
    if not experts:
        raise PlanError(f"Plan.ep={ep} splits experts, but the model has no MoE layer: use ep=1.")
    for module in experts:
        if module.num_experts % ep:
            raise PlanError(
                f"Plan.ep={ep} does not divide the MoE layers' {module.num_experts} experts: choose an ep that "
                f"divides {module.num_experts}."
            )


def shard_experts(module: nn.Module, experts: Sequence[nn.Module], ep_mesh: DeviceMesh) -> list[str]:
    """Split each of ``experts`` (modules of ``module``) over ``ep_mesh`` (this rank keeps its share) and
    point them at the ep group; return the names (in ``module``) of the expert weights, which DDP must
    leave alone."""
    check_expert_parallel(ep_mesh.size(), experts)
    ids = {}
    for unit in experts:
        for name in unit.stacked_weights:
            whole = getattr(unit, name)
            split = nn.Parameter(distribute_tensor(whole.data, ep_mesh, [Shard(0)]), requires_grad=whole.requires_grad)
            setattr(unit, name, split)
            ids[id(split)] = name
        unit.ep_group = ep_mesh.get_group()
    return [name for name, p in module.named_parameters() if id(p) in ids]


def expert_weights(experts: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The stacked weights of ``experts`` (modules with ``stacked_weights``). (Found through the modules: a mark
    set on a parameter would not survive ``module.to()``, which swaps a DTensor parameter's contents.)"""
    return [getattr(unit, name) for unit in experts for name in unit.stacked_weights]


@torch.no_grad()
def reduce_expert_grad(param: torch.Tensor, replicas: dist.ProcessGroup, dp: int) -> None:
    """Sum an expert weight's gradient over ``replicas`` (the ranks holding the same experts), divide by ``dp``."""
    if param.grad is None:
        return
    local = param.grad.to_local()
    if dist.get_world_size(replicas) > 1:
        dist.all_reduce(local, group=replicas)
    local.div_(dp)


def average_expert_grads(experts: Sequence[nn.Module], replicas: dist.ProcessGroup, dp: int, syncing: object) -> None:
    """Once a backward has finished accumulating an expert weight's gradient and gradients are synchronised
    (``syncing.require_backward_grad_sync``: false inside DDP's ``no_sync``), reduce it
    (:func:`reduce_expert_grad`). Pipeline stages reduce after the schedule instead (the engine does)."""

    def reduce(param: torch.Tensor) -> None:
        if getattr(syncing, "require_backward_grad_sync", True):
            reduce_expert_grad(param, replicas, dp)

    for weight in expert_weights(experts):
        weight.register_post_accumulate_grad_hook(reduce)
