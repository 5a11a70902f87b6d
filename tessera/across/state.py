"""What the groups' outer sync gives a checkpoint: its state (:class:`OuterState`, a checkpoint part) and
where each group's state goes (:class:`GroupShelf`: a folder per group, ``group_<g>/``, written by the
group's ranks; each group's weights differ between syncs).

The state is keyed by parameter name and laid out like the parameters (a DTensor for a shard): the
``agreed`` weights, then what exists of the outer ``momentum``, error feedback's ``remainder`` and a
transfer in flight (``arrived``: its average, waited for but applied only when due; ``sent``: the pieces as
they left); ``step``, each fragment's ``due`` step and ``kept``: whether the transfer in flight counts (1),
is dropped (0), or none is in flight (−1). The groups decide that at the save, not when it lands: a job
resumed from the checkpoint has no quorum to ask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tessera.across.outer import OuterSync
from tessera.across.slots import like
from tessera.checkpoint.parts import Shelf
from tessera.checkpoint.readers import CheckpointError
from tessera.distributed import local

FIELDS = ("agreed", "momentum", "remainder", "arrived", "sent")


class OuterState:
    """``outer``'s state for checkpoints (module docstring): a part the checkpoint saves and loads."""

    def __init__(self, outer: OuterSync) -> None:
        self.outer = outer

    def state_dict(self) -> dict[str, Any]:
        outer = self.outer
        for fragment in outer.fragments:
            outer.arrive(fragment)
            if fragment.flat is not None and fragment.kept is None:
                fragment.kept = outer.decide(fragment)
        state: dict[str, Any] = {
            "step": torch.tensor(outer.step),
            "due": torch.tensor([f.due for f in outer.fragments]),
            "kept": torch.tensor([-1 if f.kept is None else int(f.kept) for f in outer.fragments]),
            "agreed": {},
        }
        for fragment in outer.fragments:
            fields = {"agreed": fragment.agreed}
            if (momentum := fragment.momentum()) is not None:
                fields["momentum"] = momentum
            if fragment.feedback.remainder is not None:  # replicas hold a slice each: saved whole
                fields["remainder"] = fragment.split(
                    outer.slicing.whole(fragment.feedback.remainder, fragment.numel, fragment)
                )
            if fragment.flat is not None:
                fields["arrived"] = fragment.split(fragment.flat)
                if fragment.sent:
                    fields["sent"] = fragment.sent
            for field, tensors in fields.items():
                for name, param, tensor in zip(fragment.names, fragment.params, tensors):
                    state.setdefault(field, {})[name] = like(param, tensor)
        return state

    def state_to_load(self, saved: set[str]) -> dict[str, Any]:
        """A state dict shaped like :meth:`state_dict`'s, with the ``field.name`` entries a checkpoint holds
        (``saved``), to load into."""
        fragments = self.outer.fragments
        state: dict[str, Any] = {"step": torch.tensor(0), "due": torch.zeros(len(fragments), dtype=torch.long)}
        if "kept" in saved:  # checkpoints before it was saved have none: nothing of theirs was decided early
            state["kept"] = torch.zeros(len(fragments), dtype=torch.long)
        for fragment in fragments:
            for name, param, agreed, piece in zip(fragment.names, fragment.params, fragment.agreed, fragment.pieces):
                for field in FIELDS:
                    if f"{field}.{name}" in saved:
                        blank = torch.empty_like(piece if field == "sent" else agreed)
                        state.setdefault(field, {})[name] = like(param, blank)
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (its tensors laid out like this rank's)."""
        outer = self.outer
        outer.step = int(state["step"])
        for f, fragment in enumerate(outer.fragments):
            saved = {
                field: [local(state[field][n]) for n in fragment.names]
                for field in FIELDS
                if fragment.names[0] in state.get(field, {})
            }
            for agreed, value in zip(fragment.agreed, saved["agreed"]):
                agreed.copy_(value)
            fragment.optimizer.state.clear()
            fragment.set_momentum(saved.get("momentum", []))
            flat = {field: torch.cat([v.flatten() for v in saved[field]]) for field in ("remainder", "arrived")
                    if field in saved}  # fmt: skip
            remainder = flat.get("remainder")
            fragment.feedback.remainder = (
                outer.slicing.slice(remainder, fragment).clone() if remainder is not None else None
            )
            fragment.flat = flat.get("arrived")
            fragment.sent = [v.clone() for v in saved.get("sent", [])]
            fragment.work, fragment.gathered, fragment.due = None, None, int(state["due"][f])
            kept = int(state["kept"][f]) if "kept" in state else -1
            fragment.kept = None if kept < 0 else bool(kept)

    def begin_at(self, step: int) -> None:
        """A checkpoint of one model (no groups): the outer loop starts from its weights (a warm start)."""
        self.outer.start_here(step)


class GroupShelf(Shelf):
    """Group ``index`` of ``count`` writes its own folder, ``group_<index>/``, its ranks (``members``)
    together; a checkpoint ``holds`` the folders of the groups that wrote it (all of them when the groups are
    one job, its own when each group is a job of its own)."""

    def __init__(self, index: int, count: int, members: dist.ProcessGroup | None, holds: list[int]) -> None:
        self.index, self.count, self.holds = index, count, holds
        self.folder, self.members = f"group_{index}", members

    def record(self) -> dict[str, Any]:
        return {"groups": self.count, "holds": self.holds}

    def folder_to_read(self, path: Path, meta: dict[str, Any]) -> Path:
        """This group's folder of a checkpoint of as many groups; the root of a checkpoint of one model,
        which starts every group (a warm start: the outer state then begins there)."""
        saved = meta.get("groups")
        if saved is None:
            return path
        if saved != self.count:
            raise CheckpointError(
                f"checkpoint '{path}' holds {saved} groups' weights and this Plan has {self.count}: "
                f"use plan.groups.count={saved}."
            )
        return path / self.folder
