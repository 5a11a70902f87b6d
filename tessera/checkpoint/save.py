"""Writing a checkpoint: every rank's state through DCP, then the trainer's state and meta.json, atomically.

A save is written to ``step_XXXXXXXX.tmp`` and renamed only when every rank finished, so a crash mid-save
never damages the last good checkpoint; a full disk removes the partial one and says so.
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from tessera import faults
from tessera.checkpoint.files import dir_name, latest_checkpoint, run_checkpoints
from tessera.checkpoint.parts import Part, Shelf, TorchOptimizerState
from tessera.checkpoint.readers import errors_within
from tessera.checkpoint.storable import STORE_WHOLE, to_storable
from tessera.errors import RuntimeFault


def training_state(model: nn.Module, optimizer: Any) -> tuple[dict[str, Part], Shelf]:
    """The parts (by name) and the shelf of ``optimizer``: what the one ``booster.boost()`` returned holds
    (:meth:`~tessera.optim.wrapper.BoostedOptimizer.checkpoint_state`); a plain torch optimizer over
    ``model`` holds its own state alone, in the checkpoint's root."""
    if hasattr(optimizer, "checkpoint_state"):
        return optimizer.checkpoint_state()
    return {"optim": TorchOptimizerState(model, optimizer)}, Shelf()


def model_options(frozen: bool) -> StateDictOptions:
    """With or without the frozen parameters; without them a load fills the others (checked first to be
    all there) and leaves the frozen ones as the model has them."""
    return StateDictOptions(ignore_frozen_params=not frozen, strict=frozen)


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
    final, tmp = root / dir_name(step), root / (dir_name(step) + ".tmp")
    rank = dist.get_rank()
    parts, shelf = training_state(model, optimizer)
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash
            tmp.mkdir(parents=True)
        dist.barrier()
        folder = tmp / shelf.folder
        folder.mkdir(exist_ok=True)
        state = {"model": get_model_state_dict(model, options=model_options(frozen))}
        state.update({name: part.state_dict() for name, part in parts.items()})
        whole = getattr(model, STORE_WHOLE, False)
        dcp.save(to_storable(state, whole), checkpoint_id=str(folder), process_group=shelf.members)
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        faults.during_save(step)
        dist.barrier()
        if rank == 0:
            torch.save(trainer_state, tmp / "trainer.pt")
            shelved = shelf.record()
            record = {"step": step, "world_size": dist.get_world_size(), "groups": shelved.pop("groups"),
                      "frozen": frozen, **meta, **shelved}  # fmt: skip
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
