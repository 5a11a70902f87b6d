"""The outer synchronisation of ``Plan.groups``: DiLoCo's outer step across groups of ranks.

Every group trains on its own for ``inner_steps`` (H) optimizer steps. Then, on every rank, the
outer gradient of each parameter is the change since the weights the groups last agreed on
(``agreed − current``); it is averaged across the groups (one all-reduce over the ``group`` axis
of the mesh, which joins the ranks holding the same piece of the model in every group) and the
outer optimizer (SGD, Nesterov momentum by default) steps the agreed weights with it. Every
group then continues from the new agreed weights. With H = 1, an inner SGD without momentum,
outer lr 1 and no outer momentum this is synchronous SGD over the whole global batch.

Each rank works on its local piece of each parameter (a ZeRO-3 or tensor-parallel shard):
groups laid out alike hold the same piece at the same rank, and pair it directly. Groups that differ
(in size, or one shards what another replicates) meet in canonical slots instead: every group cuts
the same flat of whole parameters into as many slots as the smallest group has ranks, and rank r of
each group sends slot r. A group of whole replicas cuts its own flat; a group of shards gathers each
parameter whole inside the group to cut it, and takes its shards back from the averaged slots.

Its state (the agreed weights, the outer momentum, error feedback's remainders and a transfer in
flight) is saved in each group's checkpoint by :meth:`OuterSync.state_dict`, keyed by parameter name.

The groups meet through an :class:`Across`: the mesh's ``group`` axis when they are one job
(:class:`MeshAcross`), or torchft's quorum when each group is its own job and may fail and come
back (:class:`tessera.parallel.fault_tolerant.TorchftAcross`).

Example:
    >>> outer = OuterSync(dict(model.named_parameters()), across, Groups(count=2, inner_steps=50), [0.5, 0.5], 0)
    >>> optimizer.step(); outer.after_inner_step()   # the Booster's optimizer does this itself
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tessera.distributed import local
from tessera.errors import NotSupportedYet, PlanError
from tessera.groups import Groups
from tessera.parallel.compress import BLOCK, ErrorFeedback, sum_payloads


class Across:
    """How the groups meet at an outer sync: :meth:`begin` it, all-reduce or all-gather over the groups
    taking part, :meth:`commit` it. The groups of one job always take part, every one of them."""

    def begin(self) -> bool:
        """Start a sync; False when this group has just taken the others' state (it brings no change)."""
        return True

    def size(self) -> int:
        """How many groups take part in this sync."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        """Sum ``tensor`` over the groups, in place; returns something to ``wait()`` on."""
        raise NotImplementedError

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        """Every group's ``tensor`` into ``out``, in group order; returns something to ``wait()`` on."""
        raise NotImplementedError

    def total_weight(self, weight: float) -> float:
        """The summed batch shares of the groups taking part (this one brings ``weight``)."""
        return 1.0

    def commit(self) -> bool:
        """Whether every group taking part got the sum (False: discard this sync)."""
        return True


class MeshAcross(Across):
    """The groups of one job, over the process group joining the ranks at one place in every group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        return dist.all_gather_into_tensor(out, tensor, group=self.group, async_op=True)


@dataclass
class _Whole:
    """A parameter of the whole model as groups that differ cut their slots: its name, shape and the ranks of
    this group that hold it (all of them, or one pipeline stage's)."""

    name: str
    shape: tuple[int, ...]
    holders: list[int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _Fragment:
    """A run of the model's layers (and the parameters beside them), synced on its own turn: its agreed
    weights, their outer optimizer, and the transfer in flight (its all-reduce, when its result is due,
    and the pieces as they were when it left)."""

    def __init__(self, params: dict[str, nn.Parameter], spec: Groups) -> None:
        self.names, self.params = list(params), list(params.values())
        self.pieces = [local(p) for p in self.params]
        pieces = self.pieces
        self.agreed = [piece.detach().clone().float() for piece in pieces]  # fp32: the outer optimizer's
        self.optimizer = torch.optim.SGD(self.agreed, lr=spec.outer_lr, momentum=spec.outer_momentum,
                                         nesterov=spec.nesterov)  # fmt: skip
        self.flat: torch.Tensor | None = None
        self.part: torch.Tensor | None = None  # what this rank sends across: all of flat, or its replica's slice
        self.gathered: torch.Tensor | None = None  # compressed: every group's payload, in group order
        self.feedback = ErrorFeedback(spec.compression)
        self.work: Any = None
        self.total = 1.0  # the summed shares of the groups whose change the transfer averages
        self.due = 0
        self.sent: list[torch.Tensor] = []
        self.kept: bool | None = None  # the sync's fate when decided before it lands (at a checkpoint)

    @torch.no_grad()
    def restart(self, agreed: list[torch.Tensor], due: int) -> None:
        """Agree on ``agreed`` (one tensor per piece) with no outer momentum, error feedback or transfer in
        flight; the next transfer is due at inner step ``due``."""
        for mine, value in zip(self.agreed, agreed):
            mine.copy_(value)
        self.optimizer.state.clear()
        self.feedback.remainder = None
        self.flat, self.part, self.gathered, self.work, self.sent, self.due = None, None, None, None, [], due
        self.kept = None


class OuterSync:
    """DiLoCo's outer loop over this rank's pieces of ``params`` (by name); ``group``: the ranks holding
    the same pieces in the other groups (or an :class:`Across`); ``weights``: each group's share of the
    global batch (they sum to 1); ``index``: this rank's group; ``members``: that group's ranks (they
    write its checkpoint);
    ``blocks``: the names of the model's repeated blocks, in order (Streaming DiLoCo's fragments are
    runs of them; under pipelining, of this stage's); ``holders``: the group's ranks holding the same
    weights as this one (default ``members``).

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
        # Replicas inside a group (DDP, ZeRO-1: every rank of ``holders``, the group's ranks that hold this
        # rank's weights, holds every one of them) split the sync: each sends a slice across and they gather
        # the averaged slices, so the model crosses once per group. Under pipelining the holders are one
        # stage's data-parallel ranks, not the whole group.
        holders = holders if holders is not None else members
        replicated = holders is not None and dist.get_world_size(holders) > 1
        sharded = any(isinstance(p, DTensor) for p in params.values())
        self.replicas = holders if replicated and not sharded else None
        # Groups that differ (in size or layout) split the sync into as many canonical slots as the smallest
        # has ranks (``slots``): the holders past them send nothing across and take the averaged slots from
        # the others. Given, the slots are cut even in a group of one rank, so every group sends the same.
        self.slots = slots
        self.inside = members  # the group's ranks: a sharded or staged group cuts its slots over all of them
        which = fragment_of(list(params), blocks or [], spec.fragments)
        self.fragments = [
            _Fragment({n: p for (n, p), f in zip(params.items(), which) if f == fragment}, spec)
            for fragment in range(spec.fragments)
        ]
        # A group of shards, or of pipeline stages, cuts its slots from parameters gathered or sent whole
        # inside the group: the whole model's parameters, in order, and which ranks hold each.
        self.canon: list[list[_Whole]] | None = None
        if slots is not None and members is not None:
            self.canon = self._canonical_order(params, spec, order)
        replicas = self.replicas if self.canon is None else self.inside
        self.sends = replicas is None or dist.get_rank(replicas) < (slots or dist.get_world_size(replicas))
        self.step = 0  # inner steps taken

    def _canonical_order(
        self, params: dict[str, nn.Parameter], spec: Groups, order: list[str] | None
    ) -> list[list[_Whole]] | None:
        """Each fragment's whole parameters in the order every group cuts them, the model's (``order``: its
        parameter names; a pipeline stage may hold its own in another order), with the ranks holding each;
        None when every rank holds every parameter whole (replicas cut their own flat, in the model's order)."""
        mine = [(n, tuple(p.shape), isinstance(p, DTensor)) for n, p in params.items()]
        held: list[Any] = [None] * dist.get_world_size(self.inside)
        dist.all_gather_object(held, mine, group=self.inside)
        staged = any([n for n, _, _ in names] != [n for n, _, _ in held[0]] for names in held)
        if not staged and not any(sharded for _, _, sharded in mine):
            return None
        if staged and spec.fragments > 1:
            raise NotSupportedYet(
                "Streaming DiLoCo's fragments across groups that differ, with pipeline stages inside them, are not "
                "supported yet: use sync: diloco there (or lay the groups out alike)."
            )
        entries: dict[str, _Whole] = {}
        for rank, names in enumerate(held):
            for name, shape, _ in names:
                entries.setdefault(name, _Whole(name, shape, [])).holders.append(rank)
        if staged:
            rank_of = {name: i for i, name in enumerate(order or entries)}
            missing = [name for name in entries if name not in rank_of]
            if missing:
                raise PlanError(f"OuterSync(order=...) lacks parameters the group holds: {missing[:3]}.")
            return [sorted(entries.values(), key=lambda w: rank_of[w.name])]
        return [[entries[n] for n in fragment.names] for fragment in self.fragments]

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
    def _send(self, fragment: _Fragment) -> None:
        """Start averaging the fragment's outer gradient (agreed − current) across groups, weighted by their
        batch shares. A group that has just taken the others' state brings no change and no weight."""
        weight = self.weight if self.across.begin() else 0.0
        flat = torch.cat([(a - piece.float()).flatten() for a, piece in zip(fragment.agreed, fragment.pieces)])
        flat *= weight
        fragment.flat, fragment.due = flat, self.step + self.spec.delay
        fragment.sent = [piece.clone() for piece in fragment.pieces] if self.spec.delay else []
        fragment.part = self._slice(flat, fragment)
        fragment.total = self.across.total_weight(weight)
        if not self.sends:  # a holder past the slots: its slice is gathered from the others in _arrive
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

    def _arrive(self, fragment: _Fragment) -> None:
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
        fragment.flat = self._whole(part, fragment.flat.numel(), fragment)
        fragment.work, fragment.gathered, fragment.part = None, None, None

    def _slice(self, flat: torch.Tensor, fragment: _Fragment) -> torch.Tensor:
        """This rank's slice of ``flat`` (the fragment's local values) when replicas split the sync or slots
        are canonical, else ``flat``. Slices are whole blocks of the quantiser, so compressing them equals
        compressing the whole, block for block."""
        if self.canon is not None:
            return self._cut_slot(flat, fragment)
        if self.replicas is None and self.slots is None:
            return flat
        n = self.slots or dist.get_world_size(self.replicas)
        size = -(-flat.numel() // (n * BLOCK)) * BLOCK
        padded = torch.cat([flat, flat.new_zeros(size * n - flat.numel())])
        index = dist.get_rank(self.replicas) if self.replicas is not None else 0
        return padded[index * size :][:size] if index < n else flat.new_zeros(size)  # past the slots: nothing

    def _whole(self, part: torch.Tensor, numel: int, fragment: _Fragment) -> torch.Tensor:
        """The fragment's local values from every slice (the inverse of :meth:`_slice`), ``numel`` long."""
        if self.canon is not None:
            return self._from_slots(part, fragment)
        if self.replicas is None:
            return part[:numel]  # a slice of one: the whole, maybe padded for slots
        whole = part.new_empty(dist.get_world_size(self.replicas) * part.numel())
        dist.all_gather_into_tensor(whole, part.contiguous(), group=self.replicas)
        return whole[:numel]

    # ------------------------------------------------------------------ canonical slots of a sharded group
    def _wholes(self, fragment: _Fragment) -> list[_Whole]:
        assert self.canon is not None
        return self.canon[self.fragments.index(fragment)]

    def _slot_size(self, fragment: _Fragment) -> int:
        """Values per slot: the fragment's whole parameters cut into ``slots`` runs of whole quantiser blocks."""
        n = self.slots or 1
        total = sum(w.numel for w in self._wholes(fragment)) if self.canon else sum(p.numel() for p in fragment.params)
        return -(-total // (n * BLOCK)) * BLOCK

    def _slot_bounds(self, fragment: _Fragment) -> tuple[int, int, int]:
        """(slot size, this rank's slot start, end) in the fragment's canonical flat: every parameter whole,
        in order, cut into ``slots`` runs of whole quantiser blocks (as a group of whole replicas cuts it)."""
        size, index = self._slot_size(fragment), dist.get_rank(self.inside)
        return (size, index * size, (index + 1) * size) if index < (self.slots or 1) else (size, 0, 0)

    def _cut_slot(self, flat: torch.Tensor, fragment: _Fragment) -> torch.Tensor:
        """This rank's canonical slot of the fragment's values, from its pieces: each parameter gathered whole
        over its shards, and sent from its first holder to the group's other ranks when not every rank holds
        it (pipeline stages); one at a time, so a rank holds one whole parameter beside its slot."""
        size, lo, hi = self._slot_bounds(fragment)
        part, offset = flat.new_zeros(size), 0
        pieces = dict(zip(fragment.names, flat.split([local(p).numel() for p in fragment.params])))
        params = dict(zip(fragment.names, fragment.params))
        everyone = dist.get_world_size(self.inside)
        for w in self._wholes(fragment):
            if w.name in params:
                whole = _full(params[w.name], pieces[w.name].view(local(params[w.name]).shape)).flatten()
            else:
                whole = flat.new_empty(w.numel)
            if len(w.holders) < everyone:
                dist.broadcast(whole, src=dist.get_global_rank(self.inside, w.holders[0]), group=self.inside)
            a, b = max(lo, offset), min(hi, offset + w.numel)
            if a < b:
                part[a - lo : b - lo] = whole[a - offset : b - offset]
            offset += w.numel
        return part

    def _from_slots(self, part: torch.Tensor, fragment: _Fragment) -> torch.Tensor:
        """The fragment's local values from the group's slots (the inverse of :meth:`_cut_slot`): each
        parameter's runs broadcast from the ranks whose slots hold them, then each holder takes its piece."""
        size = self._slot_bounds(fragment)[0]
        n, pieces, offset, mine = self.slots or 1, {}, 0, dist.get_rank(self.inside)
        params = dict(zip(fragment.names, fragment.params))
        for w in self._wholes(fragment):
            whole = part.new_empty(w.numel)
            for r in range(n):
                a, b = max(r * size, offset), min((r + 1) * size, offset + w.numel)
                if a >= b:
                    continue
                run = part[a - r * size : b - r * size].clone() if mine == r else part.new_empty(b - a)
                dist.broadcast(run, src=dist.get_global_rank(self.inside, r), group=self.inside)
                whole[a - offset : b - offset] = run
            if w.name in params:
                pieces[w.name] = _shard_of(params[w.name], whole.view(w.shape)).flatten()
            offset += w.numel
        return torch.cat([pieces[name] for name in fragment.names]) if pieces else part.new_zeros(0)  # local order

    @torch.no_grad()
    def _land(self, fragment: _Fragment) -> None:
        """Wait for the fragment's average, step its agreed weights with the outer optimizer and continue from
        them (plus the local steps taken while it was in flight)."""
        self._arrive(fragment)
        assert fragment.flat is not None
        kept = self._decide(fragment) if fragment.kept is None else fragment.kept
        fragment.kept = None
        if not kept:
            self._discard(fragment)
            return
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
        fragment.flat, fragment.sent = None, []

    def _decide(self, fragment: _Fragment) -> bool:
        """Whether the sync that arrived counts: not when a group failed in the middle of it (every group
        drops it and goes back), nor when no group brought a change (only groups that had just taken the
        others' state): nothing to step with."""
        return self.across.commit() and fragment.total != 0.0

    @torch.no_grad()
    def _discard(self, fragment: _Fragment) -> None:
        """Forget a sync that not every group completed: continue from the agreed weights, which stay as
        they were (the inner steps since the last sync are lost, as torchft's DiLoCo loses them)."""
        for agreed, piece in zip(fragment.agreed, fragment.pieces):
            piece.copy_(agreed)
        fragment.flat, fragment.sent = None, []
        fragment.feedback.remainder = None  # what it carried belonged to the change just dropped

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state, keyed by parameter name and laid out like the parameters (a DTensor for
        a shard), for a checkpoint: ``agreed`` weights, then what exists of the outer ``momentum``, error
        feedback's ``remainder``, and a transfer in flight (``arrived``: its average, waited for here but
        applied only when due; ``sent``: the pieces as they left); ``step``, each fragment's ``due`` and
        ``kept``: whether the transfer in flight counts (1), is dropped (0), or none is in flight (−1). The
        groups decide that here, not when it lands: a job resumed from this checkpoint has no quorum to ask."""
        for fragment in self.fragments:
            self._arrive(fragment)
            if fragment.flat is not None and fragment.kept is None:
                fragment.kept = self._decide(fragment)
        state: dict[str, Any] = {
            "step": torch.tensor(self.step),
            "due": torch.tensor([f.due for f in self.fragments]),
            "kept": torch.tensor([-1 if f.kept is None else int(f.kept) for f in self.fragments]),
            "agreed": {},
        }
        for fragment in self.fragments:
            fields = {"agreed": fragment.agreed}
            momentum = [fragment.optimizer.state.get(a, {}).get("momentum_buffer") for a in fragment.agreed]
            if all(m is not None for m in momentum):
                fields["momentum"] = momentum
            if fragment.feedback.remainder is not None:  # replicas hold a slice each: saved whole
                numel = sum(a.numel() for a in fragment.agreed)
                remainder = self._whole(fragment.feedback.remainder, numel, fragment)
                fields["remainder"] = self._split(fragment, remainder)
            if fragment.flat is not None:
                fields["arrived"] = self._split(fragment, fragment.flat)
                if fragment.sent:
                    fields["sent"] = fragment.sent
            for field, tensors in fields.items():
                for name, param, tensor in zip(fragment.names, fragment.params, tensors):
                    state.setdefault(field, {})[name] = _like(param, tensor)
        return state

    def state_template(self, saved: set[str]) -> dict[str, Any]:
        """A state dict shaped like :meth:`state_dict`'s, with the ``field.name`` entries a checkpoint holds
        (``saved``), to load into."""
        state: dict[str, Any] = {"step": torch.tensor(0), "due": torch.zeros(len(self.fragments), dtype=torch.long)}
        if "kept" in saved:  # checkpoints before it was saved have none: nothing of theirs was decided early
            state["kept"] = torch.zeros(len(self.fragments), dtype=torch.long)
        for fragment in self.fragments:
            for name, param, agreed, piece in zip(fragment.names, fragment.params, fragment.agreed, fragment.pieces):
                for field in ("agreed", "momentum", "remainder", "arrived", "sent"):
                    if f"{field}.{name}" in saved:
                        blank = torch.empty_like(piece if field == "sent" else agreed)
                        state.setdefault(field, {})[name] = _like(param, blank)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (its tensors laid out like this rank's)."""
        self.step = int(state["step"])
        for f, fragment in enumerate(self.fragments):
            saved = {
                field: [local(state[field][n]) for n in fragment.names]
                for field in ("agreed", "momentum", "remainder", "arrived", "sent")
                if fragment.names[0] in state.get(field, {})
            }
            for agreed, value in zip(fragment.agreed, saved["agreed"]):
                agreed.copy_(value)
            fragment.optimizer.state.clear()
            for agreed, value in zip(fragment.agreed, saved.get("momentum", [])):
                fragment.optimizer.state[agreed]["momentum_buffer"] = value.clone()
            flat = {field: torch.cat([v.flatten() for v in saved[field]]) for field in ("remainder", "arrived")
                    if field in saved}  # fmt: skip
            remainder = flat.get("remainder")
            fragment.feedback.remainder = self._slice(remainder, fragment).clone() if remainder is not None else None
            fragment.flat = flat.get("arrived")
            fragment.sent = [v.clone() for v in saved.get("sent", [])]
            fragment.work, fragment.gathered, fragment.due = None, None, int(state["due"][f])
            kept = int(state["kept"][f]) if "kept" in state else -1
            fragment.kept = None if kept < 0 else bool(kept)

    @torch.no_grad()
    def start_here(self, step: int) -> None:
        """Start the outer loop from the weights the parameters hold now, at inner step ``step`` (a warm start
        from a checkpoint of one model): they become the agreed weights, with no outer momentum, error
        feedback or transfer yet; the syncs keep their turns (fragment f at (f + 1)·H/F, then every H)."""
        self.step = step
        for fragment in self.fragments:
            fragment.restart(fragment.pieces, due=0)

    # ------------------------------------------------------------------ a group coming back
    @property
    def canonical(self) -> bool:
        """Whether the groups meet in canonical slots (they differ in size or layout): a group coming back then
        takes the slots of a live group's state, not its local pieces, which another layout does not share."""
        return self.slots is not None

    @torch.no_grad()
    def slot_heal_state(self) -> dict[str, Any]:
        """What a group coming back takes from this one when they differ: the inner step count, and this rank's
        slot of each fragment's agreed weights and outer momentum. Every rank of the group calls it together
        (a sharded group gathers each parameter to cut its slot)."""
        fragments = []
        for fragment in self.fragments:
            momentum = [fragment.optimizer.state.get(a, {}).get("momentum_buffer") for a in fragment.agreed]
            flats = {"agreed": torch.cat([a.flatten() for a in fragment.agreed])}
            if all(m is not None for m in momentum):
                flats["momentum"] = torch.cat([m.flatten() for m in momentum])
            fragments.append({k: self._slice(v, fragment) for k, v in flats.items()})
        return {"step": self.step, "due": [f.due for f in self.fragments], "fragments": fragments}

    @torch.no_grad()
    def load_slot_heal_state(self, state: dict[str, Any] | None, shape: dict[str, Any]) -> None:
        """Continue from a live group's :meth:`slot_heal_state`, which this rank holds if it has a slot (else
        None); ``shape`` (the same on every rank of the group): its step, each fragment's due step and whether
        it carries momentum. Every rank of the group calls it together; each takes its pieces from the slots."""
        self.step = int(shape["step"])
        for f, fragment in enumerate(self.fragments):
            numel = sum(a.numel() for a in fragment.agreed)
            blank = fragment.agreed[0].new_zeros(self._slot_size(fragment))
            slots = state["fragments"][f] if state is not None else {}
            agreed = self._split(fragment, self._whole(slots.get("agreed", blank), numel, fragment))
            fragment.restart(agreed, int(shape["due"][f]))
            for piece, value in zip(fragment.pieces, agreed):
                piece.copy_(value)
            if shape["momentum"][f]:
                momentum = self._split(fragment, self._whole(slots.get("momentum", blank), numel, fragment))
                for a, value in zip(fragment.agreed, momentum):
                    fragment.optimizer.state[a]["momentum_buffer"] = value.clone()

    def heal_state(self) -> dict[str, Any]:
        """What a group coming back takes from this one, rank for rank (same layout, so local pieces): the
        inner step count, each fragment's agreed weights and outer momentum, and the weights themselves.
        Error feedback's remainder stays: it is each group's own."""
        fragments = []
        for fragment in self.fragments:
            momentum = [fragment.optimizer.state.get(a, {}).get("momentum_buffer") for a in fragment.agreed]
            fragments.append({
                "agreed": [a.clone() for a in fragment.agreed],
                "momentum": [m.clone() for m in momentum] if all(m is not None for m in momentum) else None,
                "pieces": [piece.detach().clone() for piece in fragment.pieces],
            })  # fmt: skip
        return {"step": self.step, "due": [f.due for f in self.fragments], "fragments": fragments}

    @torch.no_grad()
    def load_heal_state(self, state: dict[str, Any]) -> None:
        """Continue from a live group's :meth:`heal_state`."""
        self.step = int(state["step"])
        for fragment, saved, due in zip(self.fragments, state["fragments"], state["due"]):
            fragment.restart(saved["agreed"], due)
            for piece, value in zip(fragment.pieces, saved["pieces"]):
                piece.copy_(value)
            for agreed, value in zip(fragment.agreed, saved["momentum"] or []):
                fragment.optimizer.state[agreed]["momentum_buffer"] = value.clone()

    @staticmethod
    def _split(fragment: _Fragment, flat: torch.Tensor) -> list[torch.Tensor]:
        """A fragment's flat values as one tensor per piece."""
        return [t.view_as(a) for t, a in zip(flat.split([a.numel() for a in fragment.agreed]), fragment.agreed)]


def fragment_of(names: list[str], blocks: list[str], fragments: int) -> list[int]:
    """Streaming DiLoCo's fragment of each parameter: the model's blocks (layers) in ``fragments`` equal
    runs, and every parameter outside them with the run it sits beside in the model's order (the
    embeddings with the first, the final norm and head with the last)."""
    if fragments == 1:
        return [0] * len(names)
    if not blocks or len(blocks) % fragments:
        raise PlanError(
            f"Plan.groups.fragments={fragments} must divide the model's {len(blocks)} layers (its repeated "
            f"blocks): each fragment is a run of whole layers; use a divisor of {len(blocks) or 'the layer count'}."
        )
    per = len(blocks) // fragments
    out, current = [], 0
    for name in names:
        block = next((i for i, prefix in enumerate(blocks) if name.startswith(prefix + ".")), None)
        if block is not None:
            current = block // per
        out.append(current)
    return out


def _full(param: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """``piece`` (this rank's part of ``param``'s values) made whole: gathered over a shard's mesh."""
    return _like(param, piece).full_tensor() if isinstance(param, DTensor) else piece


def _shard_of(param: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` (values shaped as ``param``), laid out as its local piece is."""
    if not isinstance(param, DTensor):
        return whole
    mesh = param.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, param.placements).to_local()


def _like(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (this rank's piece of ``param``) laid out as ``param`` is: a DTensor with the same mesh and
    placements for a shard, so a checkpoint stores every rank's piece once."""
    if not isinstance(param, DTensor):
        return tensor
    return DTensor.from_local(
        tensor, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
