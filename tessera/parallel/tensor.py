"""Apply the tensor-parallel part of a Plan: the model's policy styles over the ``tp`` mesh axis.

Column-parallel projections split output features, row-parallel ones split input features
and all-reduce their output; the embedding is split over the vocabulary. Attention code needs
no change: it reshapes to ``(-1, head_dim)`` and so sees n_heads / tp local heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from tessera.parallel.policy import Policy


def apply_tensor_parallel(
    module: nn.Module,
    model: nn.Module,
    policy: Policy,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> nn.Module:
    """Shard ``module`` (``model`` itself, or one of its pipeline stages) in place over ``tp_mesh``
    as ``policy`` (the model family's) says: the styles for the submodules ``module`` holds, then the
    policy's ``after_tp`` repair. ``sequence_parallel``: norms on sequence shards too (Megatron
    split/gather); ``loss_parallel``: logits stay split over the vocabulary. The caller checks
    the sizes first (``Policy.check_tp``), before any group exists."""
    names = [name for name, _ in module.named_modules()]
    styles = policy.tensor_plan(model, sequence_parallel, loss_parallel)
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    parallelize_module(module, tp_mesh, {k: v for k, v in styles.items() if any(fnmatch(n, k) for n in names)})
    # torch's SequenceParallel re-registers the norms' weights trainable: keep frozen ones (LoRA's base) frozen
    for name, p in module.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    if policy.after_tp is not None:
        policy.after_tp(module, tp_mesh.size())
    return module


class Replicated(ParallelStyle):
    """A small layer every tp rank holds whole, between split ones (a LoRA adapter's rank-r projection).

    Its parameters become Replicate DTensors. A local input is taken as ``input_layout`` and made Replicate;
    the output goes out as ``output_layout``, local when ``use_local_output``. Its gradients are whole on
    every rank as long as what follows it all-reduces the gradient it sends back (a ColwiseParallel layer's
    input does).
    """

    def __init__(
        self,
        input_layout: Placement | None = None,
        output_layout: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__()
        self.input_layout, self.output_layout = input_layout or Replicate(), output_layout or Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(mod.named_parameters(recurse=False)):
                whole = distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                mod.register_parameter(name, nn.Parameter(whole, requires_grad=param.requires_grad))

        def prepare_input(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> DTensor:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (self.input_layout,), run_check=False)
            return x.redistribute(placements=(Replicate(),)) if x.placements != (Replicate(),) else x

        def prepare_output(_: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            if out.placements != (self.output_layout,):
                out = out.redistribute(placements=(self.output_layout,))
            return out.to_local() if self.use_local_output else out

        return distribute_module(module, device_mesh, replicate, prepare_input, prepare_output)


@torch.no_grad()
def align_grad_placements(params: Iterable[nn.Parameter]) -> None:
    """Lay each DTensor gradient out like its parameter, in place.

    Backward can leave a gradient in another layout than its parameter: a sequence-parallel
    norm's weight gradient is Partial (each rank's sum over its own tokens, not yet added up)
    and a vocabulary-parallel embedding's arrives Replicate. The norm, the clip and the optimizer
    need the parameter's layout; this is a no-op when the layouts already agree.
    """
    for p in params:
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)
