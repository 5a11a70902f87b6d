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
    >>> outer = OuterSync(list(model.parameters()), group_pg, Groups(count=2, inner_steps=50), [0.5, 0.5], index=0)
    >>> optimizer.step(); outer.after_inner_step()   # the Booster's optimizer does this itself
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.distributed import local
from tessera.errors import PlanError
from tessera.groups import Groups
from tessera.parallel.compress import ErrorFeedback, sum_payloads


class _Fragment:
    """A contiguous run of the parameters, synced on its own turn: its agreed weights, their outer
    optimizer, and the transfer in flight (its all-reduce, when its result is due, and the pieces as
    they were when it left)."""

    def __init__(self, pieces: list[torch.Tensor], spec: Groups) -> None:
        self.pieces = pieces
        self.agreed = [piece.detach().clone().float() for piece in pieces]  # fp32: the outer optimizer's
        self.optimizer = torch.optim.SGD(self.agreed, lr=spec.outer_lr, momentum=spec.outer_momentum,
                                         nesterov=spec.nesterov)  # fmt: skip
        self.flat: torch.Tensor | None = None
        self.gathered: torch.Tensor | None = None  # compressed: every group's payload, in group order
        self.feedback = ErrorFeedback(spec.compression)
        self.work: Any = None
        self.due = 0
        self.sent: list[torch.Tensor] = []


class OuterSync:
    """DiLoCo's outer loop over this rank's pieces of ``params``; ``group``: the ranks holding the same
    pieces in the other groups; ``weights``: each group's share of the global batch (they sum to 1).

    Streaming DiLoCo (``spec.fragments`` > 1) syncs one fragment of the parameters every
    ``inner_steps / fragments`` steps, in turn, so each still syncs every ``inner_steps``. With
    ``spec.delay`` τ > 0 a fragment's all-reduce runs while the next τ inner steps compute; when it
    lands, the fragment becomes the new agreed weights plus what those τ local steps changed."""

    def __init__(
        self, params: list[nn.Parameter], group: dist.ProcessGroup, spec: Groups, weights: list[float], index: int
    ) -> None:
        self.spec, self.group, self.weight = spec, group, weights[index]
        pieces = [local(p) for p in params]
        if len(pieces) < spec.fragments:
            raise PlanError(
                f"Plan.groups.fragments={spec.fragments} but this rank holds {len(pieces)} parameter tensors: "
                "use at most that many fragments."
            )
        size, extra = divmod(len(pieces), spec.fragments)
        bounds = [f * size + min(f, extra) for f in range(spec.fragments + 1)]
        self.fragments = [_Fragment(pieces[a:b], spec) for a, b in zip(bounds, bounds[1:])]
        self.step = 0  # inner steps taken

    def after_inner_step(self) -> None:
        """Count one inner optimizer step; land the transfers due now, then send the fragments whose
        turn it is (fragment f at steps (f + 1)·H/F, then every H)."""
        if self.spec.sync == "none":
            return
        self.step += 1
        for fragment in self.fragments:
            if fragment.work is not None and self.step >= fragment.due:
                self._land(fragment)
        turn = self.spec.inner_steps // self.spec.fragments
        for f, fragment in enumerate(self.fragments):
            first = (f + 1) * turn
            if self.step >= first and (self.step - first) % self.spec.inner_steps == 0:
                self._send(fragment)

    @torch.no_grad()
    def _send(self, fragment: _Fragment) -> None:
        """Start averaging the fragment's outer gradient (agreed − current) across groups, weighted by their
        batch shares."""
        flat = torch.cat([(a - piece.float()).flatten() for a, piece in zip(fragment.agreed, fragment.pieces)])
        flat *= self.weight
        fragment.flat, fragment.due = flat, self.step + self.spec.delay
        fragment.sent = [piece.clone() for piece in fragment.pieces] if self.spec.delay else []
        if self.spec.compression == "none":
            fragment.work = dist.all_reduce(flat, group=self.group, async_op=True)
        else:  # quantised values do not add up where they are: gather every group's bytes, sum them here
            payload = fragment.feedback.encode(flat)
            fragment.gathered = payload.new_empty(dist.get_world_size(self.group) * payload.numel())  # gloo: 1-D
            fragment.work = dist.all_gather_into_tensor(fragment.gathered, payload, group=self.group, async_op=True)
        if not self.spec.delay:
            self._land(fragment)

    @torch.no_grad()
    def _land(self, fragment: _Fragment) -> None:
        """Wait for the fragment's average, step its agreed weights with the outer optimizer and continue from
        them (plus the local steps taken while it was in flight)."""
        fragment.work.wait()
        assert fragment.flat is not None
        if fragment.gathered is not None:
            rows = fragment.gathered.view(dist.get_world_size(self.group), -1)
            fragment.flat = sum_payloads(rows, self.spec.compression, fragment.flat.numel())
        offset = 0
        for agreed in fragment.agreed:
            agreed.grad = fragment.flat[offset : offset + agreed.numel()].view_as(agreed)
            offset += agreed.numel()
        fragment.optimizer.step()
        fragment.optimizer.zero_grad(set_to_none=True)
        if fragment.sent:
            for agreed, piece, sent in zip(fragment.agreed, fragment.pieces, fragment.sent):
                piece.copy_(agreed + (piece - sent))
        else:
            for agreed, piece in zip(fragment.agreed, fragment.pieces):
                piece.copy_(agreed)
        fragment.flat, fragment.gathered, fragment.work, fragment.sent = None, None, None, []
