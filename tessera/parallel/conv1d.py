"""Tensor parallelism for Hugging Face ``Conv1D`` (GPT-2's projections), which torch's styles do not cover.

``Conv1D`` is a linear layer with its weight stored transposed, ``(in, out)``. GPT-2 also fuses
q, k and v into one ``c_attn`` whose outputs are ``[q | k | v]``; a plain column split would hand
rank 0 all of q and half of k. The fused weight is therefore laid out as
``_StridedShard(1, split_factor=3)``: every rank holds its slice of q, of k and of v, and the
DTensor still knows the full layout (checkpoints, full state dicts and FSDP see the real
parameter). The small fused bias stays whole on every rank (see ``_local_bias``). The forward
runs on the local shards with Megatron's two collectives.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input gradient over the tp ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over the tp ranks; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _colwise_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if self.sequence_parallel:  # x: sequence shards (DTensor); gather them, reduce-scatter the gradient
        x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    else:
        x = _CopyToParallel.apply(x, self.tp_group)
    out = torch.addmm(_local_bias(self), x.reshape(-1, x.shape[-1]), self.weight.to_local())
    return out.view(*x.shape[:-1], -1)


def _local_bias(module: nn.Module) -> torch.Tensor:
    """This rank's bias. A fused (q|k|v) bias stays whole on every rank and is sliced here: a
    strided 1-D DTensor would share dim 0 with FSDP's own split, which FSDP2 cannot describe.
    Its gradient is then each rank's slice only, so it is declared Partial and summed over tp."""
    if module.blocks == 1:
        return module.bias.to_local()
    full = module.bias.to_local(grad_placements=[Partial()]).view(module.blocks, -1)
    width = full.shape[1] // dist.get_world_size(module.tp_group)
    start = width * dist.get_rank(module.tp_group)
    return full[:, start : start + width].reshape(-1)


def _rowwise_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    partial = (x.reshape(-1, x.shape[-1]) @ self.weight.to_local()).view(*x.shape[:-1], -1)
    if self.sequence_parallel:  # reduce-scatter into sequence shards (DTensor), all-gather the gradient
        out = DTensor.from_local(partial, self.tp_mesh, [Partial()]).redistribute(placements=[Shard(1)])
        return out + self.bias
    return _ReduceFromParallel.apply(partial, self.tp_group) + self.bias.to_local()


class Conv1DParallel(ParallelStyle):
    """Column- or row-parallel ``Conv1D``; ``blocks`` > 1 splits each of that many equal output
    blocks (q, k, v) separately. With ``sequence_parallel`` (Megatron split/gather) the column
    layer takes sequence-sharded DTensor input and the row layer returns it.

    Example:
        >>> parallelize_module(model, tp_mesh, {"transformer.h.*.attn.c_attn": Conv1DParallel("colwise", blocks=3)})
    """

    def __init__(self, mode: str, blocks: int = 1, sequence_parallel: bool = False) -> None:
        super().__init__()
        if mode not in ("colwise", "rowwise"):
            raise ValueError(f"Conv1DParallel mode must be 'colwise' or 'rowwise', got {mode!r}")
        self.mode, self.blocks, self.sequence_parallel = mode, blocks, sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.mode == "colwise" and self.blocks > 1:
            placements = {"weight": _StridedShard(1, split_factor=self.blocks), "bias": Replicate()}
            forward = _colwise_forward
        elif self.mode == "colwise":
            placements = {"weight": Shard(1), "bias": Shard(0)}
            forward = _colwise_forward
        else:
            placements = {"weight": Shard(0), "bias": Replicate()}  # the bias is added once, after the sum
            forward = _rowwise_forward
        for name, placement in placements.items():
            param = getattr(module, name)
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param.detach(), device_mesh, [placement]), param.requires_grad)
            )
        module.tp_group, module.tp_mesh = device_mesh.get_group(), device_mesh
        module.blocks, module.sequence_parallel = self.blocks, self.sequence_parallel
        module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
        return module
