"""Reading checkpoint files as data only: nothing in a checkpoint can run code when it is loaded.

``torch.distributed.checkpoint`` unpickles two things without restriction: the ``.metadata``
file (``pickle.load``) and every non-tensor entry of a state dict (``torch.load(weights_only=False)``
in the default load planner). A crafted checkpoint could run code on ``--resume`` through either.
Here the metadata goes through an unpickler that builds only DCP's own metadata records, torch
dtypes and sizes, and paths; non-tensor entries go through ``weights_only=True``; and
Tessera's own files (``trainer.pt``, ``rng_rank*.pt``) through :func:`read_data`. Anything else is
refused with a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from tessera.errors import CheckpointError  # defined with the other input errors; found here too

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata records and torch dtypes/sizes; refuses every other class or function."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


_REFUSED = "holds objects that are not plain data"


def _refused(path: Path | str, exc: Exception) -> CheckpointError:
    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "not plain data"
    return CheckpointError(
        f"'{path}' {_REFUSED} ({reason}); Tessera checkpoints hold only tensors, "
        "numbers and strings, so this file was crafted or written by another program: refused, nothing loaded."
    )


class DataOnlyReader(FileSystemReader):
    """A DCP filesystem reader whose ``.metadata`` can only build metadata records."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as exc:
                raise _refused(path, exc) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"'{path}' is not a checkpoint's metadata: refused, nothing loaded.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_entry(value: io.BytesIO) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refused("a non-tensor entry of the checkpoint", exc) from None


class _DataOnlyEntries:
    """``load_bytes`` of DCP's default planner (same placement of the value), the value read as data only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        entry = _load_entry(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], entry)
        else:
            self.state_dict[read_item.dest_index.fqn] = entry


class DataOnlyLoadPlanner(_DataOnlyEntries, DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor entries read as data only."""


class DataOnlyFullLoadPlanner(_DataOnlyEntries, _EmptyStateDictLoadPlanner):
    """The planner that builds a state dict from a checkpoint's metadata (export), data only."""


def errors_within(exc: BaseException | None, depth: int = 0) -> Iterator[BaseException]:
    """``exc`` and every error it wraps: causes, contexts, and the per-rank failures that DCP
    gathers into a ``CheckpointException`` (a BaseException, not an Exception)."""
    if exc is None or depth > 8:
        return
    yield exc
    inner = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
    for candidate in (*inner, exc.__cause__, exc.__context__):
        if isinstance(candidate, BaseException) and candidate is not exc:
            yield from errors_within(candidate, depth + 1)


def refusal_inside(exc: BaseException | None) -> CheckpointError | None:
    """The CheckpointError that ``exc`` is or wraps, if any (DCP may also raise a second error
    while handling ours, or fold ours into another error's message)."""
    for error in errors_within(exc):
        if isinstance(error, CheckpointError):
            return error
        text = str(error)
        if _REFUSED in text:
            start = text.rfind("'", 0, text.find(_REFUSED) - 1)
            return CheckpointError(text[start : text.find("nothing loaded.") + len("nothing loaded.")])
    return None


def read_data(path: Path) -> object:
    """A ``torch.save`` file that may hold only data; anything that would run code is refused."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refused(path, exc) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"'{path}' is corrupted or incomplete ({first}): nothing loaded.") from None


# What ``tessera train`` keeps in a checkpoint's trainer.pt, and of what kind (``scaler`` may be None).
TRAINER_STATE = {"step": int, "epoch": int, "batch_in_epoch": int, "scheduler": dict}


def read_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer's state in checkpoint ``path`` (``trainer.pt``: step, data position, scheduler, loss
    scaler), refused with the file named when it is not that (empty, or a field of another kind)."""
    file = Path(path) / "trainer.pt"
    state = read_data(file)
    if isinstance(state, dict):
        wrong = [name for name, kind in TRAINER_STATE.items() if not _is(state.get(name), kind)]
        found = ", ".join(f"{n}={state.get(n)!r}"[:60] for n in wrong)
    else:
        wrong, found = list(TRAINER_STATE), repr(state)[:60]
    if wrong:
        raise CheckpointError(
            f"'{file}' is corrupted: it is not the trainer's state ({found}; it needs {', '.join(TRAINER_STATE)}): "
            "resume from an earlier checkpoint (move this one away), or start fresh with --overwrite."
        )
    return state  # type: ignore[return-value]


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return isinstance(value, kind)


def read_meta(path: str | Path) -> dict[str, Any]:
    """A complete checkpoint's ``meta.json``: a mapping whose world size is a count and whose groups
    (``Plan.groups`` with an outer sync) are a count or absent; refused with the file named otherwise."""
    meta_file = Path(path) / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"'{path}' is not a complete Tessera checkpoint (no meta.json).")
    try:
        meta = json.loads(meta_file.read_text())
    except (ValueError, OSError):
        meta = None
    if not isinstance(meta, dict):
        raise CheckpointError(f"'{meta_file}' is corrupted: it is not a JSON mapping.")
    world, groups = meta.get("world_size"), meta.get("groups")
    if not _is_count(world):
        raise CheckpointError(f"'{meta_file}' is corrupted: world_size={world!r} is not a count of ranks.")
    if groups is not None and not _is_count(groups):
        raise CheckpointError(f"'{meta_file}' is corrupted: groups={groups!r} is not a count.")
    return meta


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
