"""Apply the tensor-parallel part of a Plan: the model's policy styles over the ``tp`` mesh axis.

Column-parallel projections split output features, row-parallel ones split input features
and all-reduce their output; the embedding is split over the vocabulary. Attention code needs
no change: it reshapes to ``(-1, head_dim)`` and so sees n_heads / tp local heads.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from tessera.models.policies import policy_for


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` as its family's policy says."""
    policy = policy_for(model)
    policy.check_tp(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, policy.tp_plan(model))
    return model


def apply_tensor_parallel_to_stage(stage: nn.Module, model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard one pipeline stage of ``model``: the policy's styles for the modules the stage holds."""
    names = [name for name, _ in stage.named_modules()]
    plan = {
        key: style for key, style in policy_for(model).tp_plan(model).items() if any(fnmatch(n, key) for n in names)
    }
    parallelize_module(stage, tp_mesh, plan)
    return stage
