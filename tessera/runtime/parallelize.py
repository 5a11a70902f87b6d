"""One path that lays out a module, the whole model or one pipeline stage alike:
float8 linears → tensor parallel (with split/gather sequence parallelism) → recompute → compiled blocks →
data parallel / ZeRO.

Ulysses sequence parallelism routes the whole model's attention and is switched on once per
model (:func:`enable_ulysses`), before a pipeline cuts it into stages.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from tessera.errors import PlanError
from tessera.models import pretrained
from tessera.models.hf_experts import expert_modules
from tessera.parallel import data_parallel
from tessera.parallel.compile import apply_compile
from tessera.parallel.experts import average_expert_grads, shard_experts
from tessera.parallel.float8 import apply_float8, fp8_problem
from tessera.parallel.policy import Policy
from tessera.parallel.recompute import apply_recompute, without_kv_cache
from tessera.parallel.tensor import apply_tensor_parallel
from tessera.plan import Plan
from tessera.runtime.hooks import Hooks
from tessera.runtime.meshes import Meshes


def parallelize(
    module: nn.Module,
    plan: Plan,
    meshes: Meshes | None,
    policy: Policy | None,
    hooks: Hooks,
    device: torch.device,
    model: nn.Module | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Lay ``module`` out as ``plan`` says and return what to train (a wrapper or ``module``).

    ``model``: the whole model when ``module`` is one of its pipeline stages (the policy reads
    its configuration). ``meshes``: None when the plan has no grid (Plan.replicas): then only
    precision, recompute and a replica's own tensor parallelism (over ``tp_mesh``) apply, gradients
    being averaged by the replicas engine.
    """
    model = model if model is not None else module
    # Pretrained weights (model.pretrained): the parameters are still on meta; each rank gives the ones it
    # holds memory once laid out and reads its slices (before DDP, which would copy rank 0's; after FSDP).
    source = pretrained.source_of(model) if any(p.is_meta for p in module.parameters()) else None
    fsdp = data_parallel.uses_fsdp(plan)
    home = torch.device("cpu") if plan.offload and fsdp else device  # FSDP offload keeps parameters on the host
    if source is not None:
        pretrained.move_buffers(module, device)
    elif home == device:
        module.to(device)
    blocks = data_parallel.repeated_blocks(module)  # float8, recompute and FSDP change them in place: found once
    if plan.precision == "fp8":  # before tp, whose styles then split the float8 linears
        if (problem := fp8_problem(device, plan.fp8_emulate)) is not None:
            raise PlanError(problem)
        apply_float8(blocks, plan.fp8_recipe, plan.fp8_emulate, fsdp)
    if plan.tp > 1:
        assert meshes is not None
        tp_mesh = meshes.mesh["tp"]
    if tp_mesh is not None:
        assert policy is not None, "the engine checks tp against the policy first"
        split_gather = plan.sp > 1 and plan.sp_mode == "split_gather"
        apply_tensor_parallel(
            module, model, policy, tp_mesh, sequence_parallel=split_gather, loss_parallel=plan.loss_parallel
        )
    experts, own = expert_modules(module), []
    # FSDP, and torch's FSDP-based replicate that stands for DDP under tp, take the experts as units of their own
    by_units = fsdp or (plan.tp > 1 and plan.pp == 1)
    if plan.ep > 1:
        assert meshes is not None and plan.dp is not None
        names = shard_experts(module, experts, meshes.axis("ep"), plan.expert_shares)
        if by_units:  # sharded (or replicated) and averaged over the ranks holding the same experts (dp / ep)
            own = [(unit, meshes.axis("dp_rep")) for unit in experts]
            for unit in experts:  # their gradients already sum ep ranks' tokens: 1/ep makes the dp mean
                unit.grad_scale = 1 / plan.ep
        else:  # DDP must not average them: average_expert_grads does, below
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    if plan.recompute != "none":
        without_kv_cache(model)
    apply_recompute(blocks, plan.recompute)
    apply_compile(blocks, plan.compile)  # around the recompute, inside the data-parallel wrappers
    if source is not None and not fsdp:
        pretrained.materialize(module, home)
        pretrained.load_into(module, source)
    wrapped = data_parallel.apply_data_parallel(
        module,
        plan,
        meshes.sharding if meshes else None,
        device,
        blocks,
        across=meshes.across if meshes else None,
        own=own,
    )
    if source is not None and fsdp:
        pretrained.materialize(module, home)
        pretrained.load_into(module, source)
    if plan.ep > 1 and not by_units and plan.pp == 1:  # (under pp the engine reduces after the schedule)
        assert meshes is not None and plan.dp is not None
        average_expert_grads(experts, meshes.group("dp_rep"), plan.dp, wrapped)
    if meshes is not None and data_parallel.uses_fsdp(plan):
        hooks.on_sharded(module, blocks, meshes.grad_ranks())
    elif meshes is not None and isinstance(wrapped, DistributedDataParallel):
        hooks.on_replicated(wrapped, meshes.grad_ranks())
    return wrapped


def enable_ulysses(model: nn.Module, meshes: Meshes, policy: Policy) -> None:
    """Route ``model``'s attention through the Ulysses all-to-all over the ``sp`` axis."""
    policy.enable_ulysses(model, meshes.group("sp"))
