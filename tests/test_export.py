"""Export: a sharded checkpoint becomes a full safetensors file and a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import ckpt, tiny_config, train_worker

from tessera.checkpoint import CheckpointError
from tessera.export import export_hf, export_safetensors, load_full_model_state
from tessera.testing import run_ranks


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("gpt2")
    config = tiny_config(run, steps=2, every=0, plan={"preset": "zero", "zero": 3})
    config["model"]["kind"] = "hf_gpt2"
    config["train"]["measure_memory_at"] = 2  # read by the memory test below: this launch serves both
    run_ranks(train_worker, 2, config)
    return ckpt(run, 2)


def test_training_logs_each_ranks_peak_bytes_at_the_step_asked(gpt2_checkpoint: Path) -> None:
    """`train.measure_memory_at` through a real 2-rank launch: that step's record, and only it, holds every
    rank's peak tensor bytes, each above what the rank holds between steps (ZeRO-3: its shards)."""
    import json

    records = [json.loads(line) for line in (gpt2_checkpoint.parents[1] / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if "peak_tensor_bytes_per_rank" in r]
    assert [r["step"] for r in measured] == [2]
    peaks, held = measured[0]["peak_tensor_bytes_per_rank"], measured[0]["model_state_bytes_per_rank"]
    assert len(peaks) == 2 and all(p > h > 0 for p, h in zip(peaks, held)), (peaks, held)


def test_safetensors_and_hf_exports_hold_the_trained_weights(gpt2_checkpoint: Path, tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    full = load_full_model_state(gpt2_checkpoint)
    assert full["transformer.wte.weight"].shape == (256, 32)  # gathered from ZeRO-3 shards
    exported = load_file(str(export_safetensors(gpt2_checkpoint, tmp_path / "model.safetensors")))
    assert exported.keys() == full.keys()
    for k in full:
        assert torch.equal(exported[k], full[k]), k
    model = GPT2LMHeadModel.from_pretrained(str(export_hf(gpt2_checkpoint, tmp_path / "hf")))
    reloaded = model.state_dict()
    assert reloaded.keys() == full.keys(), (reloaded.keys() - full.keys(), full.keys() - reloaded.keys())
    for k, v in reloaded.items():
        assert torch.equal(v, full[k]), k


def test_hf_export_of_a_non_hf_model_is_refused(tmp_path: Path) -> None:
    run_ranks(train_worker, 2, tiny_config(tmp_path, steps=1, every=0, plan={"preset": "ddp"}))
    with pytest.raises(CheckpointError, match="model.kind='llama'"):
        export_hf(ckpt(tmp_path, 1), tmp_path / "hf")


def test_export_never_overwrites_silently_nor_writes_into_the_checkpoint(
    gpt2_checkpoint: Path, tmp_path: Path, capsys
) -> None:
    from tessera.cli import main

    def export(*argv: str) -> tuple[int, str]:
        code = main(["export", str(gpt2_checkpoint), *argv])
        return code, capsys.readouterr().err

    existing = tmp_path / "model.safetensors"
    existing.write_bytes(b"precious")
    code, err = export("--out", str(existing))
    assert code == 2 and "already exists" in err and "--force" in err, err
    assert existing.read_bytes() == b"precious"
    inside = gpt2_checkpoint / "model.safetensors"
    for argv in (["--out", str(inside)], ["--out", str(inside), "--force"], ["--hf-dir", str(gpt2_checkpoint / "hf")]):
        code, err = export(*argv)
        assert code == 2 and "inside the checkpoint" in err, err
    assert not inside.exists() and not (gpt2_checkpoint / "hf").exists()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    code, err = export("--hf-dir", str(tmp_path / "hf"))
    assert code == 2 and "not empty" in err, err
    code, err = export("--out", str(existing), "--force")
    assert code == 0 and load_file(str(existing)).keys() == load_full_model_state(gpt2_checkpoint).keys(), err
