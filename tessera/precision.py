"""Mixed precision: dtype names, autocast, and dynamic loss scaling for fp16.

bf16 and fp16 compute in low precision but keep fp32 master weights,
fp32 gradients and fp32 reductions. fp16 also scales the loss so small
gradients do not underflow; an overflow skips the step and halves the scale.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.distributed import local

# The dtype each precision computes in outside float8 matmuls (fp8: bf16 around the blocks' float8 linears)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class DynamicLossScaler:
    """Scales the loss for fp16 backward and skips steps whose gradients overflowed.

    The overflow check is agreed across all ranks, so every rank skips together.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self._good_steps = 0
        self._unscaled = False
        self._found_inf = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide gradients by the scale once per step; return True if any rank overflowed."""
        if self._unscaled:
            return self._found_inf
        grads = [local(p.grad) for p in params if p.grad is not None]
        found = torch.zeros(1)
        for g in grads:
            if not torch.isfinite(g).all():
                found.fill_(1.0)
                break
        if dist.is_initialized() and dist.get_world_size() > 1:
            dev = grads[0].device if grads else torch.device("cpu")
            found = found.to(dev)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        self._found_inf = bool(found.item())
        if not self._found_inf:
            torch._foreach_mul_(grads, 1.0 / self.scale) if grads else None
        self._unscaled = True
        return self._found_inf

    def update(self) -> None:
        """After a step (taken or skipped): back off on overflow, grow after a run of good steps."""
        if self._found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
        self._unscaled = False
        self._found_inf = False

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
