"""Experiment trackers a run mirrors its metrics to: TensorBoard, Weights & Biases, MLflow.

``metrics.jsonl`` is always written (:class:`~tessera.train.metrics.MetricsLog`); ``logging.trackers`` adds
these, on rank 0 only. Each reads its usual environment, as under any other trainer:

- ``tensorboard``: event files in ``<run dir>/tensorboard``.
- ``wandb``: ``WANDB_MODE=offline`` (or ``disabled``), ``WANDB_API_KEY``, ``WANDB_ENTITY``; the project is
  ``logging.project``. Files go to ``<run dir>/wandb``; a resumed run continues the same W&B run.
- ``mlflow``: ``MLFLOW_TRACKING_URI`` (a server); without it, a local store in ``<run dir>/mlruns`` (read it
  with ``mlflow ui --backend-store-uri <run dir>/mlruns``). The experiment is ``logging.project``.

Example:
    >>> trackers = open_trackers(["wandb"], Path("runs/demo"), "demo", "my-project", {"lr": 3e-4}, None)
    >>> for t in trackers: t.log({"loss": 2.5}, step=1)
"""

from __future__ import annotations

import netrc
import os
import secrets
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def installed(name: str) -> bool:
    """Whether tracker ``name``'s library (a module of that name; the pip extra too) can be imported here."""
    return find_spec(name) is not None


def chosen(trackers: list[str] | None, tensorboard: bool) -> list[str]:
    """The trackers a run uses: ``logging.trackers`` as given, or by default TensorBoard when installed (and not
    turned off with ``logging.tensorboard: false``)."""
    if trackers is not None:
        return list(trackers)
    return ["tensorboard"] if tensorboard and installed("tensorboard") else []


def problems(trackers: list[str]) -> list[str]:
    """What stops the listed trackers from running here, each naming the fix (empty: all can run)."""
    found = []
    for name in trackers:
        if not installed(name):
            found.append(f"logging.trackers lists {name}, which is not installed: pip install 'tessera[{name}]'")
    if "wandb" in trackers and installed("wandb") and not _wandb_can_log():
        found.append(
            "logging.trackers lists wandb, but this machine has no W&B login: set WANDB_API_KEY, run `wandb login`, "
            "or set WANDB_MODE=offline (sync later with `wandb sync`)"
        )
    return found


def _wandb_can_log() -> bool:
    """Whether W&B can start without asking for a key (which would wait on a prompt nobody sees)."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_trackers(
    names: list[str], run_dir: Path, run_name: str, project: str, config: dict[str, Any], resume_step: int | None
) -> list[Tracker]:
    """Start each named tracker for the run in ``run_dir`` (``resume_step``: the run resumes after that step)."""
    opened: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            opened.append(TensorBoard(run_dir, resume_step))
        elif name == "wandb":
            opened.append(WandB(run_dir, run_name, project, config))
        elif name == "mlflow":
            opened.append(MLflow(run_dir, run_name, project, config))
    return opened


class TensorBoard:
    """Event files in ``<run dir>/tensorboard``."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops events past the resumed step, as the restart redoes them
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run whose id is kept in ``<run dir>/wandb-run-id``, so a resumed run goes on logging to it."""

    def __init__(self, run_dir: Path, run_name: str, project: str, config: dict[str, Any]) -> None:
        import wandb

        id_file = run_dir / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)  # W&B: [a-z0-9]
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=project, name=run_name, id=run_id, resume="allow", dir=str(run_dir), config=config,
            settings=wandb.Settings(quiet=True, console="off"),
        )  # fmt: skip

    def log(self, scalars: dict[str, float], step: int) -> None:
        # W&B refuses a step lower than one it has seen; a resumed run redoes steps, so those go unlogged there
        # (metrics.jsonl keeps them).
        if step >= self.run.step:
            self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in experiment ``project``, on ``MLFLOW_TRACKING_URI`` or a local store in the run dir. Its id
    is kept in ``<run dir>/mlflow-run-id``, so a resumed run goes on logging to it."""

    def __init__(self, run_dir: Path, run_name: str, project: str, config: dict[str, Any]) -> None:
        import mlflow
        from mlflow.entities import Param

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # No server: a local file store beside the run's other outputs. MLflow 3 asks for this opt-in, as
            # its default local store (SQLite) needs the full `mlflow` package rather than mlflow-skinny.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        self.client = mlflow.MlflowClient()
        id_file = run_dir / "mlflow-run-id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            return
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        id_file.write_text(self.run_id)
        params = [Param(key, str(value)[:500]) for key, value in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``: MLflow parameters are flat."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        elif value is not None:
            out[f"{prefix}{key}"] = value
    return out
