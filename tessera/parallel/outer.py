"""The outer synchronisation of ``Plan.groups``: DiLoCo's outer step across groups of ranks.

Every group trains on its own for ``inner_steps`` (H) optimizer steps. Then, on every rank, the
outer gradient of each parameter is the change since the weights the groups last agreed on
(``agreed − current``); it is averaged across the groups (one all-reduce over the ``group`` axis
of the mesh, which joins the ranks holding the same piece of the model in every group) and the
outer optimizer (SGD, Nesterov momentum by default) steps the agreed weights with it. Every
group then continues from the new agreed weights. With H = 1, an inner SGD without momentum,
outer lr 1 and no outer momentum this is synchronous SGD over the whole global batch.

Each rank works on its local piece of each parameter (a ZeRO-3 or tensor-parallel shard):
groups are laid out alike, so the same rank of every group holds the same piece.

Example:
    >>> outer = OuterSync(list(model.parameters()), group_pg, Groups(count=2, inner_steps=50), weights=[0.5, 0.5])
    >>> optimizer.step(); outer.after_inner_step()   # the Booster's optimizer does this itself
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.distributed import local
from tessera.groups import Groups


class OuterSync:
    """DiLoCo's outer loop over this rank's pieces of ``params``; ``group``: the ranks holding the same
    pieces in the other groups; ``weights``: each group's share of the global batch (they sum to 1)."""

    def __init__(
        self, params: list[nn.Parameter], group: dist.ProcessGroup, spec: Groups, weights: list[float], index: int
    ) -> None:
        self.spec, self.group, self.weight = spec, group, weights[index]
        self.pieces = [local(p) for p in params]
        # fp32 copies of the agreed weights: the outer optimizer's parameters
        self.agreed = [piece.detach().clone().float() for piece in self.pieces]
        self.optimizer = torch.optim.SGD(
            self.agreed, lr=spec.outer_lr, momentum=spec.outer_momentum, nesterov=spec.nesterov
        )
        self.inner_steps = 0  # since the last outer step

    def after_inner_step(self) -> None:
        """Count one inner optimizer step; every ``inner_steps`` of them, run the outer step."""
        if self.spec.sync == "none":
            return
        self.inner_steps += 1
        if self.inner_steps >= self.spec.inner_steps:
            self.outer_step()

    @torch.no_grad()
    def outer_step(self) -> None:
        """Average the outer gradients across groups (weighted by their batch shares), step the agreed
        weights with the outer optimizer and continue every group from them."""
        flat = torch.cat([(agreed - piece.float()).flatten() for agreed, piece in zip(self.agreed, self.pieces)])
        flat *= self.weight
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for agreed in self.agreed:
            agreed.grad = flat[offset : offset + agreed.numel()].view_as(agreed)
            offset += agreed.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for agreed, piece in zip(self.agreed, self.pieces):
            piece.copy_(agreed)
        self.inner_steps = 0
