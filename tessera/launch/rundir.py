"""Runs own their directories: a fresh run never deletes, resumes or mixes with another run's files.

``run.json`` in the run directory names the run that owns it (a random id that ``tessera train``
makes once per launch and torchrun's restarts keep). When a rank starts, rank 0 decides:

- the directory holds this same run (a torchrun restart): continue from its newest checkpoint,
  whatever ``checkpoint.resume`` says, so a restart never silently starts again from step 0;
- it holds another run and ``checkpoint.resume: auto`` (``--resume``): continue that run;
- it holds another run and ``resume: never``: refuse;
- ``--overwrite``: delete another run's outputs and start fresh, whatever ``checkpoint.resume`` says;
- it is empty: claim it.

Every checkpoint records its run id, and only the owner's checkpoints are resumed or pruned.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from tessera.checkpoint import checkpoint_run_id, list_checkpoints
from tessera.config import ConfigError

RUN_FILE = "run.json"
RUN_ID_ENV = "TESSERA_RUN_ID"
# What a run writes in its directory besides run.json: removed by --overwrite, nothing else is. The trackers'
# files too: a kept wandb-run-id or mlflow-run-id would make the new run log into the old one.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tensorboard", "loss.png", "logs", "wandb", "wandb-run-id", "mlruns",
               "mlflow-run-id")  # fmt: skip


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


def launch_run_id() -> str:
    """This launch's run id: set by ``tessera train``, else torchrun's rendezvous id, else a new one."""
    if os.environ.get(RUN_ID_ENV):
        return os.environ[RUN_ID_ENV]
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun-{elastic}" if elastic and elastic != "none" else new_run_id()


@dataclass(frozen=True)
class RunClaim:
    """Which run this job is, and whether it continues from that run's checkpoints."""

    run_id: str
    resume: bool


def _owner(run_dir: Path) -> str | None:
    path = run_dir / RUN_FILE
    if not path.is_file():
        return None
    try:
        owner = json.loads(path.read_text()).get("run_id")
    except (ValueError, AttributeError, OSError):
        raise ConfigError(
            f"'{path}' is not a Tessera run file (corrupted?): move the run directory away, or pass --overwrite."
        ) from None
    return owner if isinstance(owner, str) else None


def _holds_a_run(run_dir: Path) -> bool:
    """Whether the directory holds anything of a run worth keeping: a checkpoint or metrics
    (a run that failed before either leaves nothing a new run could lose)."""
    metrics = run_dir / "metrics.jsonl"
    return bool(list_checkpoints(run_dir / "checkpoints")) or (metrics.is_file() and metrics.stat().st_size > 0)


def _describe(run_dir: Path) -> str:
    ckpts = list_checkpoints(run_dir / "checkpoints")
    newest = f", newest checkpoint step {int(ckpts[-1].name.split('_')[1])}" if ckpts else ""
    return f"run {_owner(run_dir) or '(unnamed)'}{newest}"


def _write_owner(run_dir: Path, run_id: str) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "created": time.time()}))
    os.replace(tmp, run_dir / RUN_FILE)


def refuse_if_taken(run_dir: Path) -> None:
    """A fresh run (``resume: never``, no ``--overwrite``) may not start where another run left its files."""
    if _holds_a_run(run_dir):
        raise ConfigError(
            f"run directory '{run_dir}' (logging.out_dir/logging.run_name) holds another run ({_describe(run_dir)}) "
            "and checkpoint.resume is 'never': continue it with --resume, choose another logging.run_name, or pass "
            "--overwrite to delete that run's checkpoints and metrics."
        )


def decide(run_dir: Path, run_id: str, resume: str, overwrite: bool) -> RunClaim:
    """Rank 0's decision (see the module docstring); raises ConfigError to refuse."""
    owner = _owner(run_dir)
    if owner == run_id:  # this same launch, restarted by torchrun
        return RunClaim(run_id, resume=True)
    if not _holds_a_run(run_dir):
        _write_owner(run_dir, run_id)
        return RunClaim(run_id, resume=False)
    if resume == "auto" and not overwrite:  # --overwrite starts fresh, whatever resume says
        if owner is None:  # written before runs had ids: adopt it under the newest checkpoint's id, or a new one
            ckpts = list_checkpoints(run_dir / "checkpoints")
            owner = (checkpoint_run_id(ckpts[-1]) if ckpts else None) or new_run_id()
            _write_owner(run_dir, owner)
        return RunClaim(owner, resume=True)
    if not overwrite:
        refuse_if_taken(run_dir)
    for name in RUN_OUTPUTS:
        target = run_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    _write_owner(run_dir, run_id)
    return RunClaim(run_id, resume=False)


def claim(run_dir: Path, resume: str, overwrite: bool) -> RunClaim:
    """Every rank calls this; rank 0 decides and tells the others (an error reaches every rank)."""
    outcome: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = decide(run_dir, launch_run_id(), resume, overwrite)
        except ConfigError as exc:
            outcome[0] = str(exc)
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], str):
        raise ConfigError(outcome[0])
    assert isinstance(outcome[0], RunClaim)
    return outcome[0]
