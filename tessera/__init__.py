"""Tessera: scale ordinary PyTorch training code with one Plan → runtime path.

Example:
    >>> import tessera
    >>> tessera.init()
    >>> booster = tessera.Booster(tessera.ZeRO(stage=2, precision="bf16"))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Names resolved on first use, so that importing a light submodule (tessera.errors, the testbed's
# seat check under a tenth of a core) does not import torch.
_EXPORTS = {
    "Auto": "tessera.presets",
    "Booster": "tessera.booster",
    "DDP": "tessera.presets",
    "Groups": "tessera.plan.groups",
    "Hybrid": "tessera.presets",
    "NotSupportedYet": "tessera.errors",
    "PipelineSpec": "tessera.plan",
    "Plan": "tessera.plan",
    "PlanError": "tessera.errors",
    "Replica": "tessera.plan",
    "ZeRO": "tessera.presets",
    "init": "tessera.distributed",
    "memory": "tessera.memory",
}

__all__ = [
    "Auto",
    "Booster",
    "DDP",
    "Groups",
    "Hybrid",
    "NotSupportedYet",
    "PipelineSpec",
    "Plan",
    "PlanError",
    "Replica",
    "ZeRO",
    "init",
    "memory",
]

if TYPE_CHECKING:
    from tessera import memory
    from tessera.booster import Booster
    from tessera.distributed import init
    from tessera.errors import NotSupportedYet, PlanError
    from tessera.plan import PipelineSpec, Plan, Replica
    from tessera.plan.groups import Groups
    from tessera.presets import DDP, Auto, Hybrid, ZeRO


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tessera' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = module if name == "memory" else getattr(module, name)
    globals()[name] = value
    return value
