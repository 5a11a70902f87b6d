"""What a component gives a checkpoint: its state (a :class:`Part`), and where that state sits (a :class:`Shelf`).

The checkpoint code saves and loads parts without knowing what they are, as Colossal-AI's plugins each own
their checkpoint I/O: the optimizer the Booster hands back holds its parts (:meth:`BoostedOptimizer.
checkpoint_state`): its own optimizer state (torch's, ZeRO-1's sharded one, converted for uneven experts),
and what attaches itself to it (the outer sync of ``Plan.groups``, which also moves the state into a
folder of its group's).

Example:
    >>> class Counter:  # a Part
    ...     def __init__(self): self.n = torch.tensor(0)
    ...     def state_dict(self): return {"n": self.n}
    ...     def state_to_load(self, saved): return {"n": torch.tensor(0)}
    ...     def load_state_dict(self, state): self.n = state["n"]
    ...     def begin_at(self, step): self.n = torch.tensor(0)
    >>> optimizer.add_checkpoint_state("counter", Counter())
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from tessera.checkpoint.readers import CheckpointError


class Part(Protocol):
    """A component's part of a checkpoint: torch's ``Stateful`` (``state_dict``/``load_state_dict``), plus
    what to read into and what to do when a checkpoint holds none of it."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state to save (tensors laid out as the component holds them)."""
        ...

    def state_to_load(self, saved: set[str]) -> dict[str, Any]:
        """A state dict to read into, given the keys the checkpoint holds under this part (``a.b`` paths)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (:meth:`state_to_load`'s, filled from the checkpoint)."""
        ...

    def begin_at(self, step: int) -> None:
        """The checkpoint (of step ``step``) holds nothing of this part: start it from the loaded model."""
        ...


class Shelf:
    """Where one rank's state sits in a checkpoint: here, the checkpoint's root, written by every rank.
    A component that splits the job (``Plan.groups`` with an outer sync: each group writes its own folder)
    gives the optimizer another shelf."""

    folder: str = ""  # a sub-folder of the checkpoint ("" : its root)
    members: dist.ProcessGroup | None = None  # the ranks that write that folder together (None: every rank)

    def record(self) -> dict[str, Any]:
        """What meta.json says of how the state is shelved (``groups``: how many groups' folders; None)."""
        return {"groups": None}

    def folder_to_read(self, path: Path, meta: dict[str, Any]) -> Path:
        """Where this rank reads the checkpoint at ``path`` (``meta``: its meta.json); refuses one shelved
        otherwise (each group's weights differ, so they cannot make one model)."""
        saved = meta.get("groups")
        if saved is not None:
            raise CheckpointError(
                f"checkpoint '{path}' holds {saved} groups' weights (Plan.groups with an outer sync), which differ "
                f"between outer syncs: resume it with plan.groups.count={saved}."
            )
        return path


class OptimizerState:
    """An optimizer's state in a checkpoint, keyed by parameter name (what torch's distributed state dicts
    hold), so it loads under any layout. Subclasses say how to :meth:`save` and :meth:`load` it."""

    def __init__(self) -> None:
        self._layout: dict[str, Any] | None = None

    def save(self) -> dict[str, Any]:
        raise NotImplementedError

    def load(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return self.save()

    def state_to_load(self, saved: set[str]) -> dict[str, Any]:
        self._layout = self.save()
        return self._layout

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self._layout is not None, "state_to_load comes first"
        _own_param_names(state, self._layout)
        self.load(state)

    def begin_at(self, step: int) -> None:
        raise CheckpointError("the checkpoint holds no optimizer state: it is incomplete.")


class TorchOptimizerState(OptimizerState):
    """A torch optimizer's state over ``model`` (its parameters, laid out), through torch's distributed
    state dicts."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        self.model, self.optimizer = model, optimizer

    def save(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)


class ConvertedState:
    """``inner``'s state as a checkpoint holds it: ``to_saved`` turns this rank's form into the saved one (in
    place), ``to_held`` the saved one back (e.g. uneven experts: every rank's rows whole in the checkpoint)."""

    def __init__(
        self, inner: Part, to_saved: Callable[[dict[str, Any]], None], to_held: Callable[[dict[str, Any]], None]
    ) -> None:
        self.inner, self.to_saved, self.to_held = inner, to_saved, to_held

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        self.to_saved(state)
        return state

    def state_to_load(self, saved: set[str]) -> dict[str, Any]:
        state = self.inner.state_to_load(saved)
        self.to_saved(state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.to_held(state)
        self.inner.load_state_dict(state)

    def begin_at(self, step: int) -> None:
        self.inner.begin_at(step)


def _own_param_names(loaded: dict[str, Any], mine: dict[str, Any]) -> None:
    """Give each loaded param group this rank's parameter names, keeping its saved hyperparameters.

    DCP stores a param-group list once for all ranks, so under pipeline stages or replicas it
    names one rank's parameters only; torch then skips, or fails on, a tied weight that rank did
    not hold under the name this rank uses."""
    groups = loaded.get("param_groups")
    if isinstance(groups, list) and len(groups) == len(mine.get("param_groups", ())):
        for group, own in zip(groups, mine["param_groups"]):
            group["params"] = list(own["params"])
