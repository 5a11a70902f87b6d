"""LAMB (You et al., 2019): Adam moments with a per-layer trust ratio ‖w‖ / ‖update‖.

Correct under every Tessera layout: each layer's norms are reduced across the
ranks holding its shards (FSDP2 DTensors, ZeRO-1 pieces) before the ratio.

Example:
    >>> opt = LAMB(model.parameters(), lr=2e-3, weight_decay=0.01)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from tessera.distributed import local
from tessera.optim.layerwise import layer_norms, trust_ratio


class LAMB(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ) -> None:
        if lr <= 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"LAMB: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            beta1, beta2 = group["betas"]
            updates, weights = [], []
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)  # a DTensor when p is one: checkpoints reshard
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                g, m, v = local(p.grad), local(state["exp_avg"]), local(state["exp_avg_sq"])
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                u = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    u.add_(local(p), alpha=group["weight_decay"])
                updates.append(u)
                weights.append(local(p))
            norms = layer_norms(params, [weights, updates])
            ratios = trust_ratio(norms[:, 0], norms[:, 1])
            for w, u, r in zip(weights, updates, ratios):
                w.add_(u, alpha=-group["lr"] * float(r))
        return loss
