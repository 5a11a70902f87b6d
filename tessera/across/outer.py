"""The outer synchronisation of ``Plan.groups``: DiLoCo's outer step across groups of ranks.

Every group trains on its own for ``inner_steps`` (H) optimizer steps. Then, on every rank, the
outer gradient of each parameter is the change since the weights the groups last agreed on
(``agreed − current``); it is averaged across the groups (one all-reduce over the ``group`` axis
of the mesh, which joins the ranks holding the same piece of the model in every group) and the
outer optimizer (SGD, Nesterov momentum by default) steps the agreed weights with it. Every
group then continues from the new agreed weights. With H = 1, an inner SGD without momentum,
outer lr 1 and no outer momentum this is synchronous SGD over the whole global batch.

Each rank works on its local piece of each parameter (a ZeRO-3 or tensor-parallel shard); what it sends
of it, and how groups that differ meet in canonical slots, is :mod:`tessera.across.slots`'s. Streaming
DiLoCo's fragments are :mod:`tessera.across.fragments`'. Its checkpoint state is
:class:`tessera.across.state.OuterState`'s, and what a group coming back takes from a live one is
:mod:`tessera.across.heal`'s.

The groups meet through an :class:`~tessera.across.meet.Across`: the mesh's ``group`` axis when they are
one job (:class:`~tessera.across.meet.MeshAcross`), or torchft's quorum when each group is its own job and
may fail and come back (:class:`tessera.across.torchft.TorchftAcross`).

Example:
    >>> outer = OuterSync(dict(model.named_parameters()), across, Groups(count=2, inner_steps=50), [0.5, 0.5], 0)
    >>> optimizer.step(); outer.after_inner_step()   # attached to the Booster's optimizer, it runs itself
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.across.compress import sum_payloads
from tessera.across.fragments import Fragment, fragment_of
from tessera.across.meet import Across, MeshAcross
from tessera.across.slots import Slicing
from tessera.plan.groups import Groups


class OuterSync:
    """DiLoCo's outer loop over this rank's pieces of ``params`` (by name); ``group``: the ranks holding
    the same pieces in the other groups (or an :class:`Across`); ``weights``: each group's share of the
    global batch (they sum to 1); ``index``: this rank's group; ``members``: that group's ranks (they
    write its checkpoint); ``blocks``: the names of the model's repeated blocks, in order (Streaming
    DiLoCo's fragments are runs of them; under pipelining, of this stage's); ``holders``: the group's ranks
    holding the same weights as this one (default ``members``); ``slots``: canonical slots when groups
    differ; ``order``: the whole model's parameter names (:class:`~tessera.across.slots.Slicing`).

    Streaming DiLoCo (``spec.fragments`` > 1) syncs one fragment of the layers every
    ``inner_steps / fragments`` steps, in turn, so each still syncs every ``inner_steps``. With
    ``spec.delay`` τ > 0 a fragment's all-reduce runs while the next τ inner steps compute; when it
    lands, the fragment becomes the new agreed weights plus what those τ local steps changed."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        group: dist.ProcessGroup | Across,
        spec: Groups,
        weights: list[float],
        index: int,
        members: dist.ProcessGroup | None = None,
        blocks: list[str] | None = None,
        holders: dist.ProcessGroup | None = None,
        slots: int | None = None,
        order: list[str] | None = None,
    ) -> None:
        self.spec, self.weight, self.index, self.members = spec, weights[index], index, members
        self.across = group if isinstance(group, Across) else MeshAcross(group)
        which = fragment_of(list(params), blocks or [], spec.fragments)
        self.fragments = [
            Fragment({n: p for (n, p), f in zip(params.items(), which) if f == fragment}, spec)
            for fragment in range(spec.fragments)
        ]
        self.slicing = Slicing(params, self.fragments, members, holders, slots, order, spec.fragments > 1)
        self.step = 0  # inner steps taken

    @property
    def canonical(self) -> bool:
        """Whether the groups meet in canonical slots (they differ in size or layout): a group coming back then
        takes the slots of a live group's state, not its local pieces, which another layout does not share."""
        return self.slicing.slots is not None

    def after_inner_step(self) -> None:
        """Count one inner optimizer step; land the transfers due now, then send the fragments whose
        turn it is (fragment f at steps (f + 1)·H/F, then every H)."""
        if self.spec.sync == "none":
            return
        self.step += 1
        for fragment in self.fragments:
            if fragment.flat is not None and self.step >= fragment.due:
                self._land(fragment)
        turn = self.spec.inner_steps // self.spec.fragments
        for f, fragment in enumerate(self.fragments):
            first = (f + 1) * turn
            if self.step >= first and (self.step - first) % self.spec.inner_steps == 0:
                self._send(fragment)

    @torch.no_grad()
    def _send(self, fragment: Fragment) -> None:
        """Start averaging the fragment's outer gradient (agreed − current) across groups, weighted by their
        batch shares. A group that has just taken the others' state brings no change and no weight."""
        weight = self.weight if self.across.begin() else 0.0
        flat = torch.cat([(a - piece.float()).flatten() for a, piece in zip(fragment.agreed, fragment.pieces)])
        flat *= weight
        fragment.flat, fragment.due = flat, self.step + self.spec.delay
        fragment.sent = [piece.clone() for piece in fragment.pieces] if self.spec.delay else []
        fragment.part = self.slicing.slice(flat, fragment)
        fragment.total = self.across.total_weight(weight)
        if not self.slicing.sends:  # a holder past the slots: its slice is gathered from the others in arrive
            if self.spec.compression != "none" and fragment.feedback.remainder is None:
                fragment.feedback.remainder = torch.zeros_like(fragment.part)  # as the senders hold one
        elif self.spec.compression == "none":
            fragment.work = self.across.all_reduce(fragment.part)
        else:  # quantised values do not add up where they are: gather every group's bytes, sum them here
            payload = fragment.feedback.encode(fragment.part)
            fragment.gathered = payload.new_empty(self.across.size() * payload.numel())  # gloo: 1-D
            fragment.work = self.across.all_gather(fragment.gathered, payload)
        if not self.spec.delay:
            self._land(fragment)

    def arrive(self, fragment: Fragment) -> None:
        """Wait for the fragment's transfer; ``flat`` is then the average (applied when it is due)."""
        if fragment.part is None:  # nothing in flight
            return
        if fragment.work is not None:
            fragment.work.wait()
        assert fragment.flat is not None
        part = fragment.part
        if fragment.gathered is not None:
            rows = fragment.gathered.view(self.across.size(), -1)
            part = sum_payloads(rows, self.spec.compression, part.numel())
        if fragment.total not in (0.0, 1.0):  # some groups sat this sync out: the average is over those that sent
            part = part / fragment.total
        fragment.flat = self.slicing.whole(part, fragment.flat.numel(), fragment)
        fragment.work, fragment.gathered, fragment.part = None, None, None

    @torch.no_grad()
    def _land(self, fragment: Fragment) -> None:
        """Wait for the fragment's average, step its agreed weights with the outer optimizer and continue from
        them (plus the local steps taken while it was in flight)."""
        self.arrive(fragment)
        assert fragment.flat is not None
        kept = self.decide(fragment) if fragment.kept is None else fragment.kept
        fragment.kept = None
        if not kept:
            self._discard(fragment)
            return
        for agreed, average in zip(fragment.agreed, fragment.split(fragment.flat)):
            agreed.grad = average
        fragment.optimizer.step()
        fragment.optimizer.zero_grad(set_to_none=True)
        if fragment.sent:
            for agreed, piece, sent in zip(fragment.agreed, fragment.pieces, fragment.sent):
                piece.copy_(agreed + (piece - sent))
        else:
            for agreed, piece in zip(fragment.agreed, fragment.pieces):
                piece.copy_(agreed)
        fragment.flat, fragment.sent = None, []

    def decide(self, fragment: Fragment) -> bool:
        """Whether the sync that arrived counts: not when a group failed in the middle of it (every group
        drops it and goes back), nor when no group brought a change (only groups that had just taken the
        others' state): nothing to step with."""
        return self.across.commit() and fragment.total != 0.0

    @torch.no_grad()
    def _discard(self, fragment: Fragment) -> None:
        """Forget a sync that not every group completed: continue from the agreed weights, which stay as
        they were (the inner steps since the last sync are lost, as torchft's DiLoCo loses them)."""
        for agreed, piece in zip(fragment.agreed, fragment.pieces):
            piece.copy_(agreed)
        fragment.flat, fragment.sent = None, []
        fragment.feedback.remainder = None  # what it carried belonged to the change just dropped

    @torch.no_grad()
    def start_here(self, step: int) -> None:
        """Start the outer loop from the weights the parameters hold now, at inner step ``step`` (a warm start
        from a checkpoint of one model): they become the agreed weights, with no outer momentum, error
        feedback or transfer yet; the syncs keep their turns (fragment f at (f + 1)·H/F, then every H)."""
        self.step = step
        for fragment in self.fragments:
            fragment.restart(fragment.pieces, due=0)
