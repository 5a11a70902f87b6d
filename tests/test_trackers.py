"""Experiment trackers (issue 33, item 6): TensorBoard, W&B (offline) and MLflow (a local store) each hold the
numbers metrics.jsonl holds, read back through their own files; a resumed run goes on in the same tracker
run; a tracker that cannot run here is refused before launch, naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tracker_files import mlflow_history, tensorboard_scalars, wandb_history

from tessera import trackers
from tessera.config import ConfigError, parse_config
from tessera.train.metrics import MetricsLog, latest_records


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings from the machine
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _log_steps(run_dir: Path, steps: range, resume_step: int | None) -> None:
    names = ["tensorboard", "wandb", "mlflow"]
    opened = trackers.open_trackers(names, run_dir, "tiny", "tests", {"optimizer": {"lr": 0.1}}, resume_step)
    log = MetricsLog(run_dir, resume_step, opened)
    for step in steps:
        log.log({"step": step, "loss": 10.0 / step + (0.5 if resume_step else 0), "traffic": {"inter_node": step}})
    log.close()


def test_each_tracker_holds_what_metrics_jsonl_holds_across_a_resume(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 5), None)
    _log_steps(tmp_path, range(3, 7), resume_step=2)  # steps 3 and 4 redone, with other losses
    expected = {r["step"]: r["loss"] for r in latest_records(tmp_path / "metrics.jsonl")}
    assert sorted(expected) == [1, 2, 3, 4, 5, 6] and expected[3] == pytest.approx(10 / 3 + 0.5)
    board = tensorboard_scalars(tmp_path, "loss")
    assert board == pytest.approx(expected)  # purge_step dropped the first try's steps 3 and 4
    assert tensorboard_scalars(tmp_path, "traffic/inter_node") == pytest.approx({s: float(s) for s in expected})
    flow, names = mlflow_history(tmp_path, "loss")
    assert names == ["tiny"], names  # the resumed run logged to the same MLflow run
    assert {s: v for s, v in flow.items() if s in (1, 2, 5, 6)} == pytest.approx({s: expected[s] for s in (1, 2, 5, 6)})
    wandb = wandb_history(tmp_path, "loss")
    assert {s: wandb[s] for s in (1, 2, 5, 6)} == pytest.approx({s: expected[s] for s in (1, 2, 5, 6)})
    # one W&B run id for both tries: the resumed run continued the first one
    assert len({p.name.split("-")[-1] for p in (tmp_path / "wandb").glob("offline-run-*")}) == 1
    assert (tmp_path / "wandb-run-id").read_text() and (tmp_path / "mlflow-run-id").read_text()


def test_tracker_choice_and_what_stops_one_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert trackers.chosen(None, tensorboard=True) == ["tensorboard"]  # installed in the test environment
    assert trackers.chosen(None, tensorboard=False) == [] and trackers.chosen(["mlflow"], True) == ["mlflow"]
    assert trackers.problems(["tensorboard", "wandb", "mlflow"]) == []  # WANDB_MODE=offline
    monkeypatch.delenv("WANDB_MODE")
    (wandb_problem,) = trackers.problems(["wandb"])
    assert "no W&B login: set WANDB_API_KEY, run `wandb login`, or set WANDB_MODE=offline" in wandb_problem
    monkeypatch.setattr(trackers, "installed", lambda name: name != "mlflow")
    assert trackers.problems(["mlflow"]) == [
        "logging.trackers lists mlflow, which is not installed: pip install 'tessera[mlflow]'"
    ]
    with pytest.raises(
        ConfigError, match="'logging.trackers.0': Input should be 'tensorboard', 'wandb' or 'mlflow' \\(got 'comet'\\)"
    ):
        parse_config({"logging": {"trackers": ["comet"]}})
    with pytest.raises(ConfigError, match="logging.tensorboard: false, but logging.trackers lists tensorboard"):
        parse_config({"logging": {"trackers": ["tensorboard"], "tensorboard": False}})


def test_a_missing_tracker_is_refused_before_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera.launch.preflight import check_training

    monkeypatch.delenv("WANDB_MODE")
    demo = json.dumps({"logging": {"out_dir": str(tmp_path), "trackers": ["wandb"]}})
    (tmp_path / "c.yaml").write_text(demo)
    with pytest.raises(ConfigError, match="lists wandb, but this machine has no W&B login"):
        check_training(str(tmp_path / "c.yaml"), [], 1, 1, False)
