"""Apply the tensor-parallel part of a Plan: the model's policy styles over the ``tp`` mesh axis.

Column-parallel projections split output features, row-parallel ones split input features
and all-reduce their output; the embedding is split over the vocabulary. Attention code needs
no change: it reshapes to ``(-1, head_dim)`` and so sees n_heads / tp local heads.
"""

from __future__ import annotations

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
