"""LARS (You et al., 2017): SGD with momentum and a per-layer learning-rate ratio.

local_lr = η · ‖w‖ / (‖g‖ + λ‖w‖); v ← μ·v + lr · local_lr · (g + λw); w ← w − v.
Norms span the whole layer across every shard (see tessera.optim.layerwise).

Example:
    >>> opt = LARS(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from tessera.distributed import local
from tessera.optim.layerwise import layer_norms


class LARS(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
    ) -> None:
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or trust_coefficient <= 0:
            raise ValueError(
                f"LARS: invalid lr={lr}, momentum={momentum}, weight_decay={weight_decay} "
                f"or trust_coefficient={trust_coefficient}"
            )
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            weights = [local(p) for p in params]
            grads = [local(p.grad) for p in params]
            norms = layer_norms(params, [weights, grads])
            wd = group["weight_decay"]
            # η‖w‖/(‖g‖ + λ‖w‖) where both norms are non-zero, else 1 (as in the paper's reference code)
            w_norm, g_norm = norms[:, 0], norms[:, 1]
            ratios = torch.where(
                (w_norm > 0) & (g_norm > 0),
                group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm).clamp_min(1e-30),
                torch.ones_like(w_norm),
            )
            for p, w, g, r in zip(params, weights, grads, ratios):
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = local(state["momentum_buffer"])
                d = g.add(w, alpha=wd) if wd else g
                buf.mul_(group["momentum"]).add_(d, alpha=group["lr"] * float(r))
                w.sub_(buf)
        return loss
