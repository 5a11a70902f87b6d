"""Build the optimizer a training config names (the model: :mod:`tessera.models.build`)."""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import Config
from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS


def build_optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names, over ``params``."""
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "lamb":
        return LAMB(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    if o.name == "lars":
        return LARS(
            params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, trust_coefficient=o.trust_coefficient
        )
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
