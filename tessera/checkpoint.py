"""Checkpoints that survive crashes and load under another layout.

Model and optimizer state go through ``torch.distributed.checkpoint`` keyed by
parameter name (FQN), so a checkpoint written under DDP, ZeRO-1/2/3 or uneven
shares loads under any other of them, on another number of ranks. A save is
written to ``step_XXXXXXXX.tmp`` and renamed only when every rank finished, so
a crash mid-save never damages the last good checkpoint.

Layout of one checkpoint directory::

    step_00000100/
        .metadata, __*.distcp      DCP: {"model": ..., "optim": ...}
        trainer.pt                 step, data position, scheduler, loss scaler (rank 0)
        rng_rank{r}.pt             each rank's RNG states (restored when the world size matches)
        meta.json                  step, world size, run id, plan — written last: marks the checkpoint complete

A checkpoint may leave the frozen parameters out (``frozen=False``: LoRA's base, read again from its
pretrained files on resume): meta.json's ``frozen`` is then false and loading fills the others only.

Under ``Plan.groups`` with an outer sync (diloco, streaming, none) each group's weights differ between
syncs, so each group writes its own DCP folder, ``group_<g>/``, holding also its outer state
(``"outer"``: agreed weights, outer momentum, error feedback, a transfer in flight; see
:meth:`~tessera.parallel.outer.OuterSync.state_dict`); meta.json's ``groups`` says how many.
A checkpoint of one model resumes under such groups too (a warm start, as DiLoCo starts from a
pretrained model): every group reads the same weights and optimizer state, and the outer sync
starts there, its agreed weights those, with no outer momentum yet.

Checkpoints hold only data: every file is read through :mod:`tessera.checkpoint_readers` (tensors,
numbers, strings, containers and DCP's metadata records), so a crafted file cannot run code on
``--resume``; it is refused.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from tessera import faults
from tessera.checkpoint_readers import (
    CheckpointError,
    DataOnlyLoadPlanner,
    DataOnlyReader,
    errors_within,
    read_data,
    read_meta,
    refusal_inside,
)
from tessera.data.sharding import map_tensors
from tessera.errors import RuntimeFault
from tessera.parallel.experts import held_optimizer_state, uneven_expert_names, whole_optimizer_state
from tessera.parallel.outer import MeshAcross
from tessera.parallel.zero1 import ShardedOptimizer


def _dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (a ``.tmp`` or one without meta.json is not complete)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def checkpoint_run_id(path: Path) -> str | None:
    """The id of the run that wrote the checkpoint at ``path`` (None: written before runs had ids)."""
    try:
        run_id = json.loads((path / "meta.json").read_text()).get("run_id")
    except (ValueError, AttributeError, OSError):
        return None
    return run_id if isinstance(run_id, str) else None


def run_checkpoints(root: str | Path, run_id: str | None) -> list[Path]:
    """Complete checkpoints of run ``run_id`` (and any without an id), oldest first."""
    return [p for p in list_checkpoints(root) if run_id is None or checkpoint_run_id(p) in (run_id, None)]


def latest_checkpoint(root: str | Path, run_id: str | None = None) -> Path | None:
    done = run_checkpoints(root, run_id)
    return done[-1] if done else None


# --------------------------------------------------------------------------- state dicts
def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "inner", optimizer)


def _outer(optimizer: Any) -> Any:
    """The optimizer's outer sync across Plan.groups (an OuterSync), or None."""
    return getattr(optimizer, "outer", None)


def _state_dicts(
    model: nn.Module, optimizer: Any, outer_keys: set[str] | None = None, frozen: bool = True
) -> dict[str, Any]:
    """What a checkpoint holds for this rank; ``outer_keys``: the outer state's entries a checkpoint holds,
    to load into (None: this rank's outer state as it is, to save); ``frozen``: with the frozen parameters."""
    inner = _inner(optimizer)
    if isinstance(inner, ShardedOptimizer):
        optim = inner.full_state_dict(_param_names(model))
    else:
        optim = get_optimizer_state_dict(model, inner)
    whole_optimizer_state(optim, uneven_expert_names(model, _param_names(model)))  # (the model's: its state dict)
    state = {"model": get_model_state_dict(model, options=_model_options(frozen)), "optim": optim}
    if (outer := _outer(optimizer)) is not None:
        state["outer"] = outer.state_dict() if outer_keys is None else outer.state_template(outer_keys)
    return state


def _model_options(frozen: bool) -> StateDictOptions:
    """With or without the frozen parameters; without them a load fills the others (checked first to be
    all there: :func:`_check_same_model`) and leaves the frozen ones as the model has them."""
    return StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)


def _dcp_folder(path: Path, optimizer: Any) -> tuple[Path, dist.ProcessGroup | None]:
    """Where this rank's DCP state lives in the checkpoint at ``path``, and the ranks that share it."""
    outer = _outer(optimizer)
    return (path, None) if outer is None else (path / f"group_{outer.index}", outer.members)


def _storable(placements: tuple) -> tuple | None:
    """Placements DCP can store for a DTensor laid out as ``placements``, or None if it can already.

    DCP stores each rank's shard as one contiguous chunk. A strided split that no later mesh
    dimension refines (GPT-2's fused q|k|v weight: every rank holds three separate column
    ranges) is not one chunk, so it is stored gathered along that mesh dimension. FSDP-over-tp's
    strided split is refined by the tp Shard after it, and DCP stores that fine.
    """
    out = list(placements)
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard) and not any(q.is_shard(p.dim) for q in placements[i + 1 :]):
            out[i] = Replicate()
    return tuple(out) if out != list(placements) else None


def _to_storable(tree: Any) -> Any:
    """``tree`` with every DTensor DCP cannot store redistributed to placements it can (a copy)."""

    def storable(t: torch.Tensor) -> torch.Tensor:
        placements = _storable(t.placements) if isinstance(t, DTensor) else None
        return t.redistribute(placements=placements) if placements is not None else t

    return map_tensors(tree, storable)


def _from_storable(loaded: Any, like: Any) -> Any:
    """``loaded`` with each tensor laid out like its twin in ``like`` (undoes :func:`_to_storable`)."""
    if isinstance(loaded, dict):
        return {k: _from_storable(v, like[k]) for k, v in loaded.items()}
    if isinstance(loaded, list):
        return [_from_storable(v, w) for v, w in zip(loaded, like)]
    if isinstance(loaded, DTensor) and isinstance(like, DTensor) and loaded.placements != like.placements:
        return loaded.redistribute(placements=like.placements)
    return loaded


def _param_names(model: nn.Module) -> dict[int, str]:
    from tessera.parallel.data_parallel import unwrap

    return {id(p): name for name, p in unwrap(model).named_parameters()}


# --------------------------------------------------------------------------------- save
def save_checkpoint(
    root: str | Path,
    step: int,
    model: nn.Module,
    optimizer: Any,
    trainer_state: dict[str, Any],
    keep: int,
    meta: dict[str, Any],
    frozen: bool = True,
) -> Path:
    """Write a checkpoint of ``step`` under ``root`` on every rank; keep the newest ``keep`` of this run
    (``meta["run_id"]``); another run's checkpoints are never touched. ``frozen=False``: leave the frozen
    parameters out (LoRA's base, when the caller can read it again).

    A full disk removes the partial checkpoint and raises :class:`~tessera.errors.RuntimeFault`:
    the previous checkpoint stays intact.
    """
    root = Path(root)
    final, tmp = root / _dir_name(step), root / (_dir_name(step) + ".tmp")
    rank = dist.get_rank()
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash
            tmp.mkdir(parents=True)
        dist.barrier()
        folder, members = _dcp_folder(tmp, optimizer)
        folder.mkdir(exist_ok=True)
        state = _to_storable(_state_dicts(model, optimizer, frozen=frozen))
        dcp.save(state, checkpoint_id=str(folder), process_group=members)
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        faults.during_save(step)
        dist.barrier()
        if rank == 0:
            torch.save(trainer_state, tmp / "trainer.pt")
            groups = outer.spec.count if (outer := _outer(optimizer)) is not None else None
            record = {"step": step, "world_size": dist.get_world_size(), "groups": groups, "frozen": frozen, **meta}
            if outer is not None:  # which group folders this one holds: each job's own under fault tolerance
                record["holds"] = list(range(groups)) if isinstance(outer.across, MeshAcross) else [outer.index]
            (tmp / "meta.json").write_text(json.dumps(record))
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if not _disk_full(exc):
            raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(root, meta.get("run_id"))
        kept = f"the last complete checkpoint, '{previous}', is intact" if previous else "no earlier checkpoint exists"
        raise RuntimeFault(
            f"the disk is full (the partial step-{step} checkpoint under '{root}' was removed; {kept}): "
            "free space, then continue with --resume."
        ) from None
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in run_checkpoints(root, meta.get("run_id"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it wraps (DCP gathers every rank's failure) is a full disk or quota."""
    return any(
        (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
        or "No space left on device" in str(e)
        or "Disk quota exceeded" in str(e)
        for e in errors_within(exc)
    )


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# --------------------------------------------------------------------------------- load
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


def _check_same_groups(path: Path, saved: int | None, optimizer: Any) -> None:
    """Refuse a checkpoint of Plan.groups under a Plan with other groups, or none: each group's weights differ.
    (A checkpoint of one model is not checked here: it starts every group, see :func:`load_checkpoint`.)"""
    outer = _outer(optimizer)
    mine = outer.spec.count if outer is not None else None
    if saved == mine:
        return
    if mine is None:
        raise CheckpointError(
            f"checkpoint '{path}' holds {saved} groups' weights (Plan.groups with an outer sync), which differ "
            f"between outer syncs: resume it with plan.groups.count={saved}."
        )
    raise CheckpointError(
        f"checkpoint '{path}' holds {saved} groups' weights and this Plan has {mine}: use plan.groups.count={saved}."
    )


def _check_same_model(path: Path, metadata: Any, expected: dict[str, Any]) -> None:
    """Refuse a checkpoint whose parameter names or shapes differ: list every mismatch."""
    saved = {
        k[len("model.") :]: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }
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


def _own_param_names(loaded: dict[str, Any], mine: dict[str, Any]) -> None:
    """Give each loaded param group this rank's parameter names, keeping its saved hyperparameters.

    DCP stores a param-group list once for all ranks, so under pipeline stages or replicas it
    names one rank's parameters only; torch then skips, or fails on, a tied weight that rank did
    not hold under the name this rank uses."""
    groups = loaded.get("param_groups")
    if isinstance(groups, list) and len(groups) == len(mine.get("param_groups", ())):
        for group, own in zip(groups, mine["param_groups"]):
            group["params"] = list(own["params"])


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Load model and optimizer state (any layout) from ``path``; return the trainer state."""
    path = Path(path)
    meta = read_meta(path)
    outer = _outer(optimizer)
    warm_start = meta.get("groups") is None and outer is not None  # one model: every group starts from it
    if not warm_start:
        _check_same_groups(path, meta.get("groups"), optimizer)
    folder, members = _dcp_folder(path, optimizer)
    if warm_start:
        folder = path
    metadata = _read_metadata(folder)
    outer_keys = {k.removeprefix("outer.") for k in metadata.state_dict_metadata if k.startswith("outer.")}
    frozen = meta.get("frozen", True)
    if not isinstance(frozen, bool):
        raise CheckpointError(f"'{path / 'meta.json'}' is corrupted: frozen={frozen!r} is not true or false.")
    layout = _state_dicts(model, optimizer, outer_keys, frozen)
    if warm_start:
        del layout["outer"]
    _check_same_model(folder, metadata, layout["model"])
    trainer_state = read_data(path / "trainer.pt")  # small and checked first: an unsafe file stops everything
    state = _to_storable(layout)
    try:
        dcp.load(
            state, storage_reader=DataOnlyReader(str(folder)), planner=DataOnlyLoadPlanner(), process_group=members
        )
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        if (refused := refusal_inside(exc)) is not None:
            raise refused from None
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint '{path}' could not be read: it is corrupted or incomplete ({reason})."
        ) from None
    state = _from_storable(state, layout)
    _own_param_names(state["optim"], layout["optim"])
    held_optimizer_state(state["optim"], uneven_expert_names(model, _param_names(model)))
    set_model_state_dict(model, state["model"], options=_model_options(frozen))
    inner = _inner(optimizer)
    if isinstance(inner, ShardedOptimizer):
        inner.load_full_state_dict(state["optim"], _param_names(model))
    else:
        set_optimizer_state_dict(model, inner, state["optim"])
    if warm_start:
        outer.start_here(trainer_state["step"])
    elif outer is not None:
        outer.load_state_dict(state["outer"])
    same_world = meta["world_size"] == dist.get_world_size()
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if same_world and rng_file.is_file():
        rng = read_data(rng_file)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return trainer_state
