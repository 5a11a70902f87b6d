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

from tessera.models.policies import policy_for


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, loss_parallel: bool = False
) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` as its family's policy says; with
    ``sequence_parallel`` the norms also run on sequence shards (Megatron split/gather), with
    ``loss_parallel`` the logits stay split over the vocabulary."""
    policy = policy_for(model)
    policy.check_tp(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, policy.tensor_plan(model, sequence_parallel, loss_parallel))
    if policy.after_tp is not None:
        policy.after_tp(model, tp_mesh.size())
    return model


def apply_tensor_parallel_to_stage(
    stage: nn.Module, model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool = False
) -> nn.Module:
    """Shard one pipeline stage of ``model``: the policy's styles for the modules the stage holds."""
    names = [name for name, _ in stage.named_modules()]
    styles = policy_for(model).tensor_plan(model, loss_parallel=loss_parallel)
    plan = {key: style for key, style in styles.items() if any(fnmatch(n, key) for n in names)}
    parallelize_module(stage, tp_mesh, plan)
    policy = policy_for(model)
    if policy.after_tp is not None:
        policy.after_tp(stage, tp_mesh.size())
    return stage


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
