"""Tessera: scale ordinary PyTorch training code with one Plan → runtime path.

Example:
    >>> import tessera
    >>> tessera.init()
    >>> booster = tessera.Booster(tessera.ZeRO(stage=2, precision="bf16"))
"""

from tessera import memory
from tessera.booster import Booster
from tessera.distributed import init
from tessera.errors import NotSupportedYet, PlanError
from tessera.plan import PipelineSpec, Plan, Replica
from tessera.presets import DDP, Auto, Hybrid, ZeRO

__version__ = "0.1.0"

__all__ = [
    "Auto",
    "Booster",
    "DDP",
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
