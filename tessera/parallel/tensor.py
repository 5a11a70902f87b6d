"""Apply the tensor-parallel part of a Plan: the model's policy styles over the ``tp`` mesh axis.

Column-parallel projections split output features, row-parallel ones split input features
and all-reduce their output; the embedding is split over the vocabulary. Attention code needs
no change: it reshapes to ``(-1, head_dim)`` and so sees n_heads / tp local heads.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

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
    parallelize_module(module, tp_mesh, {k: v for k, v in styles.items() if any(fnmatch(n, k) for n in names)})
    if policy.after_tp is not None:
        policy.after_tp(module, tp_mesh.size())
    return module


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
