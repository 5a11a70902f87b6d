"""Runs own their directories (reliability issue, item 3), checked on the files alone (no ranks):
a fresh run never deletes, resumes or mixes with another run's files; metrics.jsonl is only appended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.checkpoint import latest_checkpoint, run_checkpoints
from tessera.config import ConfigError
from tessera.launch.rundir import RUN_FILE, decide
from tessera.train.metrics import MetricsLog, latest_records


def fake_checkpoint(run_dir: Path, step: int, run_id: str | None) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    meta = {"step": step, "world_size": 1} | ({"run_id": run_id} if run_id else {})
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def owner(run_dir: Path) -> str:
    return json.loads((run_dir / RUN_FILE).read_text())["run_id"]


def test_an_empty_directory_is_claimed(tmp_path: Path) -> None:
    claim = decide(tmp_path / "run", "new", "never", overwrite=False)
    assert claim.run_id == "new" and not claim.resume and owner(tmp_path / "run") == "new"


def test_a_restart_of_the_same_run_continues_even_with_resume_never(tmp_path: Path) -> None:
    decide(tmp_path, "a", "never", overwrite=False)
    fake_checkpoint(tmp_path, 4, "a")
    claim = decide(tmp_path, "a", "never", overwrite=False)
    assert claim.resume and claim.run_id == "a"


def test_a_fresh_run_refuses_another_runs_directory_and_touches_nothing(tmp_path: Path) -> None:
    decide(tmp_path, "old", "never", overwrite=False)
    old = fake_checkpoint(tmp_path, 400, "old")
    (tmp_path / "metrics.jsonl").write_text('{"step": 400, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match=r"holds another run \(run old, newest checkpoint step 400\).*--overwrite"):
        decide(tmp_path, "new", "never", overwrite=False)
    assert old.is_dir() and owner(tmp_path) == "old" and "400" in (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.parametrize("resume", ["never", "auto"])
def test_overwrite_replaces_the_old_run_whatever_resume_says(tmp_path: Path, resume: str) -> None:
    decide(tmp_path, "old", "never", overwrite=False)
    fake_checkpoint(tmp_path, 400, "old")
    (tmp_path / "metrics.jsonl").write_text('{"step": 400}\n')
    (tmp_path / "notes.txt").write_text("mine")  # not a run output: kept
    (tmp_path / "wandb-run-id").write_text("old1")  # kept, the new run would log into the old W&B run
    claim = decide(tmp_path, "new", resume, overwrite=True)  # the example's resume: auto, too (issue 33)
    assert not claim.resume and owner(tmp_path) == "new"
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "wandb-run-id").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_resume_auto_continues_the_run_that_owns_the_directory(tmp_path: Path) -> None:
    decide(tmp_path, "old", "never", overwrite=False)
    fake_checkpoint(tmp_path, 8, "old")
    claim = decide(tmp_path, "new-launch", "auto", overwrite=False)
    assert claim.resume and claim.run_id == "old"


def test_a_directory_from_before_run_ids_is_adopted_by_resume(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 8, None)
    with pytest.raises(ConfigError, match="holds another run"):
        decide(tmp_path, "new", "never", overwrite=False)
    claim = decide(tmp_path, "new", "auto", overwrite=False)
    assert claim.resume and owner(tmp_path) == claim.run_id


def test_a_run_that_left_nothing_does_not_block_the_next(tmp_path: Path) -> None:
    decide(tmp_path, "crashed-at-set-up", "never", overwrite=False)
    (tmp_path / "logs").mkdir()
    assert decide(tmp_path, "next", "never", overwrite=False).run_id == "next"


def test_only_the_owners_checkpoints_are_resumed_or_pruned(tmp_path: Path) -> None:
    """The old bug: keep-K pruned the new run's low-numbered checkpoints and kept an old run's high ones."""
    fake_checkpoint(tmp_path, 900, "old")
    mine = [fake_checkpoint(tmp_path, s, "new") for s in (10, 20, 30)]
    assert run_checkpoints(tmp_path / "checkpoints", "new") == mine
    assert latest_checkpoint(tmp_path / "checkpoints", "new") == mine[-1]
    assert latest_checkpoint(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step_00000900"


def test_metrics_are_appended_and_a_resumed_run_crashing_early_loses_nothing(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    for step in (1, 2, 3, 4):
        log.log({"step": step, "loss": 10.0 - step})
    log.close()
    before = (tmp_path / "metrics.jsonl").read_text()
    MetricsLog(tmp_path, resume_step=2)  # resumed from step 2, crashes before logging
    after = (tmp_path / "metrics.jsonl").read_text()
    assert after.startswith(before), "a resumed run rewrote the records already written"
    log = MetricsLog(tmp_path, resume_step=2)
    log.log({"step": 3, "loss": 0.5})  # the redone step 3 supersedes the first one
    log.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # a line torn by a crash
    records = latest_records(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in records] == [(1, 9.0), (2, 8.0), (3, 0.5)]  # old step 4: redone later


def save_three_beside_a_foreign_checkpoint(root: str) -> list[str]:
    import torch

    from tessera.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (10, 20, 30):
        save_checkpoint(root, step, model, optimizer, {"step": step}, keep=2, meta={"run_id": "new"})
    return sorted(p.name for p in Path(root).iterdir())


def test_saving_prunes_only_this_runs_checkpoints(tmp_path: Path) -> None:
    from tessera.testing import run_ranks

    fake_checkpoint(tmp_path, 900, "old")
    (names,) = run_ranks(save_three_beside_a_foreign_checkpoint, 1, str(tmp_path / "checkpoints"))
    assert names == ["step_00000020", "step_00000030", "step_00000900"]
