"""Reading a checkpoint into a laid-out model and its optimizer, under any layout.

The model's names and shapes are checked against the checkpoint's first (a mismatch lists every one and
loads nothing), every file is read as data only (:mod:`tessera.checkpoint.readers`), and each part the
optimizer holds (:mod:`tessera.checkpoint.parts`) takes its state back, or begins afresh where the
checkpoint holds none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from tessera.checkpoint.readers import (
    CheckpointError,
    DataOnlyLoadPlanner,
    DataOnlyReader,
    read_data,
    read_meta,
    refusal_inside,
)
from tessera.checkpoint.save import model_options, training_state
from tessera.checkpoint.storable import from_storable, to_storable


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Load model and optimizer state (any layout) from ``path``; return the trainer state."""
    path = Path(path)
    meta = read_meta(path)
    parts, shelf = training_state(model, optimizer)
    folder = shelf.folder_to_read(path, meta)
    metadata = _read_metadata(folder)
    saved: dict[str, set[str]] = {}  # the checkpoint's keys under each part, less the part's name
    for key in metadata.state_dict_metadata:
        name, _, rest = key.partition(".")
        saved.setdefault(name, set()).add(rest)
    frozen = meta.get("frozen", True)
    if not isinstance(frozen, bool):
        raise CheckpointError(f"'{path / 'meta.json'}' is corrupted: frozen={frozen!r} is not true or false.")
    layout = {"model": get_model_state_dict(model, options=model_options(frozen))}
    layout.update({name: part.state_to_load(saved[name]) for name, part in parts.items() if name in saved})
    _check_same_model(folder, metadata, layout["model"])
    trainer_state = read_data(path / "trainer.pt")  # small and checked first: an unsafe file stops everything
    _check_shards(folder, metadata, path)  # a truncated or missing shard is named before DCP reads any of it
    state = to_storable(layout)
    try:
        reader = DataOnlyReader(str(folder))
        dcp.load(state, storage_reader=reader, planner=DataOnlyLoadPlanner(), process_group=shelf.members)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if (refused := refusal_inside(exc)) is not None:
            raise refused from None
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint '{path}' could not be read: it is corrupted or incomplete ({reason})."
        ) from None
    state = from_storable(state, layout)
    set_model_state_dict(model, state["model"], options=model_options(frozen))
    for name, part in parts.items():
        if name in state:
            part.load_state_dict(state[name])
        else:  # written before the part existed (a checkpoint of one model, resumed under groups)
            part.begin_at(trainer_state["step"])
    same_world = meta["world_size"] == dist.get_world_size()
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if same_world and rng_file.is_file():
        rng = read_data(rng_file)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return trainer_state


def _read_metadata(path: Path) -> Any:
    """DCP's metadata of the state under ``path`` (refused with a clear error when unreadable)."""
    try:
        return DataOnlyReader(str(path)).read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:  # unreadable or truncated metadata
        raise CheckpointError(
            f"checkpoint '{path}' is corrupted or unreadable ({type(exc).__name__}: {exc})."
        ) from None


def check_complete(path: str | Path) -> None:
    """Refuse a checkpoint a shard of which is missing or shorter than its metadata says (a copy cut short,
    a disk that filled): every folder under ``path`` holding DCP state is checked, reading only sizes."""
    for meta_file in sorted(Path(path).rglob(".metadata")):
        _check_shards(meta_file.parent, _read_metadata(meta_file.parent), path)


def _check_shards(folder: Path, metadata: Any, path: str | Path) -> None:
    """Every shard file ``metadata`` (the DCP state in ``folder``, of checkpoint ``path``) reads from is there
    and reaches as far as its furthest entry."""
    needed: dict[str, int] = {}  # each shard file's bytes, as far as the metadata reaches into it
    for info in (metadata.storage_data or {}).values():
        file = str(getattr(info, "relative_path", ""))
        needed[file] = max(needed.get(file, 0), int(info.offset) + int(info.length))
    for file, size in sorted(needed.items()):
        shard = folder / file
        have = shard.stat().st_size if shard.is_file() else None
        if have is None or have < size:
            found = "is missing" if have is None else f"holds {have:,} bytes where its metadata needs {size:,}"
            raise CheckpointError(
                f"checkpoint '{path}' is corrupted or incomplete: '{shard}' {found} (a copy cut short or a full "
                "disk?). Resume from an earlier checkpoint (move this one away), or start fresh with --overwrite."
            )


def check_model_shapes(path: str | Path, model: nn.Module) -> None:
    """Refuse a checkpoint at ``path`` of a model other than ``model`` (built on meta: names and shapes
    only), before any rank starts: a parameter both hold with another shape, or no name in common. (Names
    only one side holds are the ranks' to judge, where the layout and LoRA's frozen weights are known.)"""
    saved = _model_shapes(_read_metadata(Path(path)))
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    common = sorted(saved.keys() & want.keys())
    differ = [f"shape of {k}: checkpoint {saved[k]} vs model {want[k]}" for k in common if saved[k] != want[k]]
    if saved and not common:
        differ = [f"no parameter name in common (the checkpoint's first: {sorted(saved)[0]})"]
    if differ:
        shown = "; ".join(differ[:12]) + (f"; and {len(differ) - 12} more" if len(differ) > 12 else "")
        raise CheckpointError(f"checkpoint '{path}' belongs to a different model: {shown}. Nothing was loaded.")


def _model_shapes(metadata: Any) -> dict[str, tuple[int, ...]]:
    """The model's parameter names and whole shapes in a checkpoint's DCP metadata."""
    return {
        k[len("model.") :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def _check_same_model(path: Path, metadata: Any, expected: dict[str, Any]) -> None:
    """Refuse a checkpoint whose parameter names or shapes differ: list every mismatch."""
    saved = _model_shapes(metadata)
    # Pipeline stages each hold part of the model: compare with the union over every rank.
    mine = {k: tuple(v.shape) for k, v in expected.items() if isinstance(v, torch.Tensor)}
    parts: list[dict[str, tuple[int, ...]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, mine)
    want = {k: shape for part in parts for k, shape in part.items()}
    problems = [f"missing in checkpoint: {k} {want[k]}" for k in sorted(want.keys() - saved.keys())]
    problems += [f"not in this model: {k} {saved[k]}" for k in sorted(saved.keys() - want.keys())]
    problems += [
        f"shape of {k}: checkpoint {saved[k]} vs model {want[k]}"
        for k in sorted(want.keys() & saved.keys())
        if saved[k] != want[k]
    ]
    if problems:
        shown = "; ".join(problems[:12]) + (f"; and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise CheckpointError(f"checkpoint '{path}' belongs to a different model: {shown}. Nothing was loaded.")
