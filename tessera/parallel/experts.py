"""Apply the expert-parallel part of a Plan: each MoE layer's experts split over the ``ep`` mesh axis
(the reference Llama's and Hugging Face's stacked experts alike: modules with ``stacked_weights``,
``num_experts``, ``ep_group`` and ``grad_scale``, found by :func:`tessera.models.hf_experts.expert_modules`).

The ep ranks are neighbouring data-parallel ranks: each holds ``experts / ep`` experts of every MoE layer,
or ``Plan.expert_shares`` of them (its stacked weights become DTensors split on the expert dimension, or
plain tensors of its rows whose state dicts gather them whole, so checkpoints hold whole layers and load
under any ep) and the tokens routed to an expert travel to its rank and back
(:func:`tessera.models.moe.exchange`). Gradients: an expert's gradient on its rank already sums the
contributions of the tokens of every ep rank (the all-to-all's backward brings them), so it is summed over
the ranks that hold the same experts (``dp / ep`` of them: the "dp_rep" axis) and divided by dp, which
makes it the gradient of the data-parallel mean loss; every other parameter is averaged over dp as usual
(DDP leaves the experts to this module).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tessera.checkpoint.parts import ConvertedState, Part
from tessera.distributed import local
from tessera.errors import PlanError


def check_expert_parallel(ep: int, experts: Sequence[nn.Module], shares: Sequence[int] | None = None) -> None:
    """Refuse an ep (or expert shares) the model's experts cannot be split by, or a model without any."""
    if ep == 1:
        return
    if not experts:
        raise PlanError(
            f"Plan.ep={ep} splits experts, but the model has no experts Tessera can split (expert parallelism takes "
            "the reference Llama's model.moe and Hugging Face MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts): "
            "use ep=1."
        )
    for module in experts:
        if shares is not None and sum(shares) != module.num_experts:
            raise PlanError(
                f"Plan.expert_shares={list(shares)} sum to {sum(shares)}, but the MoE layers have "
                f"{module.num_experts} experts: give shares that sum to {module.num_experts}."
            )
        if shares is None and module.num_experts % ep:
            raise PlanError(
                f"Plan.ep={ep} does not divide the MoE layers' {module.num_experts} experts: choose an ep that "
                f"divides {module.num_experts} (or give Plan.expert_shares)."
            )


def shard_experts(
    module: nn.Module, experts: Sequence[nn.Module], ep_mesh: DeviceMesh, shares: Sequence[int] | None = None
) -> list[str]:
    """Split each of ``experts`` (modules of ``module``) over ``ep_mesh`` (this rank keeps its share:
    ``shares[r]`` experts on ep rank r, or an even split) and point them at the ep group; return the names
    (in ``module``) of the expert weights, which DDP must leave alone.

    Even splits are DTensors (checkpoints hold whole layers through DCP). Uneven ones (``shares``) are this
    rank's rows as a plain tensor, which DTensor cannot describe: the module's state dict gathers them
    whole and its loading keeps this rank's rows (:func:`whole_experts`, :func:`held_experts`)."""
    check_expert_parallel(ep_mesh.size(), experts, shares)
    ids = {}
    for unit in experts:
        unit.ep_shares = tuple(shares) if shares is not None else None
        unit.ep_group = ep_mesh.get_group()
        for name in unit.stacked_weights:
            whole = getattr(unit, name)
            if shares is None:
                split = distribute_tensor(whole.data, ep_mesh, [Shard(0)])
            else:
                first, count = held_range(unit)
                split = whole.data[first : first + count].clone()
            split = nn.Parameter(split, requires_grad=whole.requires_grad)
            setattr(unit, name, split)
            ids[id(split)] = name
        if shares is not None:
            unit.register_state_dict_post_hook(_whole_in_state_dict)
            unit.register_load_state_dict_pre_hook(_held_from_state_dict)
    return [name for name, p in module.named_parameters() if id(p) in ids]


def held_range(unit: nn.Module) -> tuple[int, int]:
    """The first expert this rank holds of ``unit`` and how many (uneven ``ep_shares``)."""
    rank = dist.get_rank(unit.ep_group)
    return sum(unit.ep_shares[:rank]), unit.ep_shares[rank]


@torch.no_grad()
def whole_experts(held: torch.Tensor, unit: nn.Module) -> torch.Tensor:
    """Every rank's experts of a tensor laid out like ``unit``'s stacked weights (this rank's rows in
    ``held``): gathered over the ep ranks, padded to the largest share for the all-gather."""
    if isinstance(held, DTensor):  # this rank's experts as FSDP shards them (or replicate holds them) over dp_rep
        held = held.full_tensor()
    most = max(unit.ep_shares)
    padded = held.new_zeros((most, *held.shape[1:]))
    padded[: len(held)] = held
    parts = [torch.empty_like(padded) for _ in unit.ep_shares]
    dist.all_gather(parts, padded, group=unit.ep_group)
    return torch.cat([part[:count] for part, count in zip(parts, unit.ep_shares)])


def held_experts(whole: torch.Tensor, unit: nn.Module) -> torch.Tensor:
    """This rank's rows of a whole tensor laid out like ``unit``'s stacked weights."""
    first, count = held_range(unit)
    return whole[first : first + count]


def _whole_in_state_dict(unit: nn.Module, state: dict[str, Any], prefix: str, _metadata: Any) -> None:
    for name in unit.stacked_weights:
        if prefix + name in state:
            state[prefix + name] = whole_experts(state[prefix + name].detach(), unit)


def _held_from_state_dict(unit: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    for name in unit.stacked_weights:
        value = state.get(prefix + name)
        current = getattr(unit, name)
        if isinstance(value, torch.Tensor) and len(value) == unit.num_experts != len(current):
            state[prefix + name] = laid_out_like(current, held_experts(local(value), unit))


def laid_out_like(weight: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's experts, whole) laid out as ``weight`` is: sharded (FSDP) or replicated (tp's
    replicate) over dp_rep when ``weight`` is a DTensor there; each rank takes its part of its own copy."""
    if not isinstance(weight, DTensor):
        return value
    value = value.to(weight.device)
    return distribute_tensor(value, weight.device_mesh, weight.placements, src_data_rank=None)


def uneven_expert_names(model: nn.Module, names: dict[int, str]) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """The names (``names``: parameter id → name) of the expert weights split unevenly, with their module
    and the weight itself."""
    return {
        names[id(weight)]: (unit, weight)
        for unit in model.modules()
        if getattr(unit, "ep_shares", None) is not None
        for weight in (getattr(unit, name) for name in unit.stacked_weights)
        if id(weight) in names
    }


def uneven_expert_groups(model: nn.Module) -> dict[int, tuple[dist.ProcessGroup, ...]]:
    """For each expert weight split unevenly (by id, as the model holds it now), the groups its elements are
    split over, which norms must add up over (DTensors say so themselves; these plain tensors cannot)."""
    return {
        id(getattr(unit, weight)): (unit.ep_group,)
        for unit in model.modules()
        if getattr(unit, "ep_shares", None) is not None
        for weight in unit.stacked_weights
    }


def whole_optimizer_state(state: dict[str, Any], uneven: dict[str, tuple[nn.Module, torch.Tensor]]) -> None:
    """In an optimizer state dict keyed by parameter name, make the per-expert state (Adam's moments) of
    the ``uneven`` expert weights whole (every rank's experts), as checkpoints hold them."""
    for name, (unit, _) in uneven.items():
        _replace(state, name, held_range(unit)[1], lambda value, unit=unit: whole_experts(value, unit))


def held_optimizer_state(state: dict[str, Any], uneven: dict[str, tuple[nn.Module, torch.Tensor]]) -> None:
    """The inverse of :func:`whole_optimizer_state`: keep this rank's experts' rows, laid out as the weight."""
    for name, (unit, weight) in uneven.items():
        _replace(
            state,
            name,
            unit.num_experts,
            lambda value, u=unit, w=weight: laid_out_like(w, held_experts(local(value), u)),
        )


def uneven_experts_state(optimizer_state: Part, model: nn.Module, names: Callable[[], dict[int, str]]) -> Part:
    """``optimizer_state`` (a checkpoint part) as checkpoints hold it when ``model`` splits experts unevenly:
    each uneven expert weight's per-expert state whole, every rank's rows (``names()``: parameter id → name)."""

    def uneven() -> dict[str, tuple[nn.Module, torch.Tensor]]:
        return uneven_expert_names(model, names())

    return ConvertedState(
        optimizer_state,
        to_saved=lambda state: whole_optimizer_state(state, uneven()),
        to_held=lambda state: held_optimizer_state(state, uneven()),
    )


def _replace(state: dict[str, Any], name: str, rows: int, change: Any) -> None:
    """Change the entries of ``name``'s optimizer state that hold a row per expert (``rows`` of them) into a
    new entry (torch's state dicts may share their entries with the optimizer's live state)."""
    entry = state["state"].get(name)
    if entry is not None:
        state["state"][name] = {
            k: change(v) if isinstance(v, torch.Tensor) and v.dim() > 0 and len(v) == rows else v
            for k, v in entry.items()
        }


def expert_weights(experts: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The stacked weights of ``experts`` (modules with ``stacked_weights``). (Found through the modules: a mark
    set on a parameter would not survive ``module.to()``, which swaps a DTensor parameter's contents.)"""
    return [getattr(unit, name) for unit in experts for name in unit.stacked_weights]


@torch.no_grad()
def reduce_expert_grad(param: torch.Tensor, replicas: dist.ProcessGroup, dp: int) -> None:
    """Sum an expert weight's gradient over ``replicas`` (the ranks holding the same experts), divide by ``dp``."""
    if param.grad is None:
        return
    local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
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
