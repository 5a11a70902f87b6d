"""Held-out evaluation (issue 15, item 4): `data.validation` holds out the last sequences, `eval.every`
logs their loss and perplexity; the figure equals a plain forward of the checkpointed model over them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from test_checkpoint import tiny_config

from tessera.config import ConfigError, parse_config


def test_eval_every_logs_the_held_out_loss_of_the_trained_model_under_a_pipeline(tmp_path: Path) -> None:
    from tessera.data.text import PackedText, resolve_paths
    from tessera.export import load_full_model_state
    from tessera.models.build import build_model

    config = tiny_config(tmp_path / "runs", 4, 4, {"preset": "ddp", "pp": 2, "microbatches": 2})
    config["data"]["validation"] = 0.1
    config["eval"] = {"every": 2, "batches": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "tessera.cli", "train", str(tmp_path / "c.yaml"), "--nproc", "2"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "t"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held = {r["step"]: r for r in records if "val_loss" in r}
    assert sorted(held) == [2, 4]
    assert held[4]["val_perplexity"] == pytest.approx(math.exp(held[4]["val_loss"]))

    cfg = parse_config(config)  # the same held-out sequences through a plain model of the step-4 weights
    model = build_model(cfg)
    model.load_state_dict(load_full_model_state(run / "checkpoints" / "step_00000004"))
    data = PackedText(resolve_paths(cfg.data.paths), cfg.data.seq_len, cfg.data.max_bytes)
    first = len(data) - int(len(data) * 0.1)
    losses = []
    with torch.no_grad():
        for b in range(2):
            items = [data[first + b * 8 + i] for i in range(8)]
            x, y = torch.stack([i["x"] for i in items]), torch.stack([i["y"] for i in items])
            losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    assert held[4]["val_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
    assert held[4]["val_loss"] != pytest.approx(held[2]["val_loss"], rel=1e-6)  # it moved with training


def test_eval_without_held_out_data_or_with_too_little_is_refused(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, 4, 4, {"preset": "ddp"})
    with pytest.raises(ConfigError, match="eval.every=2 evaluates on held-out sequences: set data.validation"):
        parse_config({**config, "eval": {"every": 2}})
    from tessera.data.held_out import split_validation

    with pytest.raises(ConfigError, match=r"holds out 5 of the data's 100 sequences, .* each need a whole global "
                       r"batch \(train.global_batch_size=8\): set data.validation between 0.08 and 0.49"):  # fmt: skip
        split_validation(list(range(100)), 0.05, 8)
    train, held = split_validation(list(range(100)), 0.08, 8)  # the smallest share the refusal named works
    assert list(train) == list(range(92)) and list(held) == list(range(92, 100))
    split_validation(list(range(100)), 0.49, 8)  # and the largest
    with pytest.raises(ConfigError, match="16 sequences cannot give both: lower train.global_batch_size to 7 or less"):
        split_validation(list(range(16)), 0.05, 16)  # the fine-tuning example's 16 packed sequences (issue 33)
    split_validation(list(range(16)), 0.45, 7)


def _evaluate_under_a_v_schedule() -> str:
    from parity import TokenData, build_model, loss_fn

    import tessera
    from tessera.errors import NotSupportedYet

    booster = tessera.Booster(tessera.Plan(pp=2, pipeline={"schedule": "zbv_zero_bubble", "microbatches": 4}))
    model, _ = booster.boost(build_model("llama:8"))
    batch = next(iter(booster.dataloader(TokenData(), global_batch_size=8, seed=0)))
    try:
        booster.evaluate(batch, model, loss_fn)
    except NotSupportedYet as exc:
        return str(exc)
    return "evaluated"


def test_evaluation_under_a_v_schedule_is_refused_by_name(tmp_path: Path) -> None:
    from tessera.launch.preflight import check_training
    from tessera.testing import run_ranks

    said = run_ranks(_evaluate_under_a_v_schedule, 2, timeout_s=120)
    assert all("schedule 'zbv_zero_bubble' are not supported yet" in s for s in said), said
    config = tiny_config(tmp_path, 4, 4, {"preset": "ddp", "pp": 2, "microbatches": 4, "schedule": "dualpipev"})
    config["model"]["n_layers"] = 4  # a layer for each of the V schedule's 4 stages (checked before launch too)
    config["data"]["validation"] = 0.1
    config["eval"] = {"every": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="schedule 'dualpipev' cannot"):
        check_training(str(tmp_path / "c.yaml"), [], 2, 1, overwrite=True)
