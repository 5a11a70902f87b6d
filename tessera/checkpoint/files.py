"""Finding checkpoints: the complete ones under a folder, oldest first, and the run that wrote each.

A checkpoint is complete when its ``meta.json`` exists: it is written last, after every rank finished, and
the folder is renamed from ``step_XXXXXXXX.tmp`` only then.
"""

from __future__ import annotations

import json
from pathlib import Path


def dir_name(step: int) -> str:
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
