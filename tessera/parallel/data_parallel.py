"""Apply the data-parallel part of a Plan: DDP, ZeRO-1, ZeRO-2 or ZeRO-3.

Engines (see docs/architecture.md for why):
    zero=0  torch DDP (torch's FSDP2-based ``replicate`` for tensor-parallel DTensor parameters)
    zero=1  the same for gradients + our ShardedOptimizer (optimizer state 1/N)
    zero=2  FSDP2 ``fully_shard(reshard_after_forward=False)``
    zero=3  FSDP2 ``fully_shard`` (each block's parameters resharded after forward; the root's kept)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from tessera.across.hierarchical import Hierarchy, hierarchical_all_reduce
from tessera.distributed import accelerator_available
from tessera.plan import Plan
from tessera.precision import DTYPES

# Gradient buckets: DDP's (its default size, set here explicitly) and the flat all-reduces Tessera
# writes itself (replicas' per-layer sync); the cost model counts the same staging copy.
BUCKET_BYTES = 25 * 2**20


def uses_fsdp(plan: Plan) -> bool:
    return plan.zero >= 2


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: children of the outermost ModuleLists (or a pipeline stage's
    ModuleDicts) of same-typed modules.

    Each gets its own FSDP2 unit, so only one block's full parameters exist at a time.
    """
    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(t + ".") for t in taken):
            continue
        children = list(module.children())
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and children and len({type(m) for m in children}) == 1:
            if any(True for _ in children[0].parameters()):
                blocks.extend(children)
                taken.append(name)
    return blocks


def _autocast_forward(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Run ``model.forward`` under autocast (fp32 weights, low-precision compute)."""
    forward = model.forward
    model.forward = torch.autocast(device_type=device.type, dtype=dtype)(forward)  # type: ignore[method-assign]


def apply_data_parallel(
    model: nn.Module,
    plan: Plan,
    mesh: DeviceMesh | None,
    device: torch.device,
    blocks: list[nn.Module] | None = None,
    across: dist.ProcessGroup | None = None,
    own: Sequence[tuple[nn.Module, DeviceMesh]] = (),
) -> nn.Module:
    """Wrap ``model`` for the Plan's ZeRO stage over ``mesh`` (the 1-D ``dp`` mesh; None under
    Plan.replicas; 2-D (group, dp) for FSDP with every-step groups); ``blocks``: its
    :func:`repeated_blocks`, when the caller has them already; ``across``: with every-step groups,
    the group axis DDP's gradients also cross (hierarchically, :mod:`tessera.across.hierarchical`);
    ``own``: under FSDP, ``(submodule, mesh)`` units sharded (and their gradients averaged) over a mesh of
    their own, first (experts over the ranks that hold them)."""
    blocks = blocks if blocks is not None else repeated_blocks(model)
    dtype = DTYPES[plan.precision]
    if not uses_fsdp(plan):
        model.to(device)
        if dtype != torch.float32:
            _autocast_forward(model, device, dtype)
        if plan.pp > 1:  # the schedule runs backward: gradients are averaged after it (pipeline.average_gradients)
            return model
        if plan.replicas is not None:  # averaged per layer over its holders (replicas.LayerSync)
            return model
        if plan.tp > 1:
            return _replicate(model, mesh, blocks, own)
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=mesh.get_group(),
            gradient_as_bucket_view=True,  # gradients live in the buckets: no second copy
            bucket_cap_mb=BUCKET_BYTES / 2**20,
        )
        if across is not None:
            ddp.register_comm_hook(Hierarchy(mesh.get_group(), across), hierarchical_all_reduce)
        return ddp
    mp = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=accelerator_available()) if plan.offload else OffloadPolicy()
    reshard = plan.zero == 3
    if not plan.offload and not any(p.is_meta for p in model.parameters()):  # on meta: given memory once sharded
        model.to(device)
    for unit, unit_mesh in own:
        fully_shard(unit, mesh=unit_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    # The root (embedding, head, final norm) stays gathered from its forward to its backward, which comes
    # right after (FSDP2's own default for a root, and torchtitan's): resharding it would gather it again.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    return model


def _replicate(
    model: nn.Module, mesh: DeviceMesh, blocks: list[nn.Module], own: Sequence[tuple[nn.Module, DeviceMesh]] = ()
) -> nn.Module:
    """DDP for tensor-parallel (DTensor) parameters, which torch's DDP cannot hold: torch's
    FSDP2-based ``replicate`` over the dp mesh, one unit per block so reductions overlap backward
    (``own`` units first, over their own meshes)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for unit, unit_mesh in own:  # (even over one rank: the dp units below must leave them alone)
        replicate(unit, mesh=unit_mesh)
    if mesh.size() == 1:
        return model  # nothing to synchronise
    for block in blocks:
        replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)
    return model


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP unit of ``model`` (nothing for other layouts)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside any wrapper Tessera added."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally; the next backward outside this context synchronises."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
