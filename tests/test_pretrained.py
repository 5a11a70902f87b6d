"""Pretrained Hugging Face weights into any layout (issue 15, item 1).

A model saved with ``save_pretrained`` in several safetensors files is loaded by Tessera (parameters on
meta, each rank reading the slices it holds once laid out) and trained; plain transformers
``from_pretrained`` on one process is the reference: same losses, gradient norms, first gradients and
parameters after 3 AdamW steps (fp32, 1e-5), in every layout. Bad directories are one clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity import PRETRAINED, build_model, check_cases
from safetensors.torch import load_file, save_file
from test_data_parallel_parity import PRESETS

import tessera
from tessera.inputs import InputError
from tessera.models.pretrained import empty_pretrained, load_into, materialize, source_of
from tessera.plan import Replica

GLOBAL_BATCH, STEPS = 8, 3


def _save(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(str(path), max_shard_size="40KB")  # several files and an index
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The parity suite's 4-layer Hugging Face Llama (untied), saved in shards."""
    return _save(build_model("hf_llama:4"), tmp_path_factory.mktemp("pretrained") / "hf_llama")


def _loaded(path: Path) -> torch.nn.Module:
    model = empty_pretrained(path)
    assert all(p.is_meta for p in model.parameters())  # nothing allocated before the layout
    materialize(model, torch.device("cpu"))
    load_into(model, source_of(model))
    return model


def test_one_process_loads_the_same_logits_and_keeps_tied_weights_tied(tmp_path: Path) -> None:
    tied = build_model("gpt2")  # GPT-2 ties its head to the embeddings: stored once
    path = _save(tied, tmp_path / "gpt2")
    model = _loaded(path)
    assert model.lm_head.weight is model.transformer.wte.weight
    x = torch.randint(0, 128, (2, 16))
    assert torch.equal(model(x).logits, tied(x).logits)


def test_pretrained_weights_train_like_the_original_in_every_layout(saved: Path) -> None:
    """4 ranks: DDP, ZeRO-1/2/3, ZeRO-3 offloaded, dp2 × tp2 under ZeRO-3 (compiled: test_compiled_blocks), dp2 × pp2,
    dp2 × Ulysses sp2, and replicas of depth 1 and 3; and LoRA adapters under dp × tp, dp × pp and tp × pp
    (against peft on one process), and experts under ep2 × dp2 with DDP and ZeRO-3 (each expert's gradient
    summed over its 2 holders) and pp2 × ep2 with 2 micro-batches (expert gradients reduced once, after the
    schedule), even and with experts 1:3, and tp2 × ep2 (attention split over tp, the experts over ep, whole on
    both ranks of a tp pair)."""
    kind = f"{PRETRAINED}{saved}"
    plans = {
        **PRESETS,  # DDP, ZeRO-1/2/3, ZeRO-3 offloaded
        "dp2 x tp2 zero3": tessera.Plan(tp=2, zero=3),
        "dp2 x pp2": tessera.Plan(pp=2, pipeline={"microbatches": 2}),
        "dp2 x sp2": tessera.Plan(sp=2),
        "replicas of depth 1 and 3": tessera.Plan(
            replicas=(Replica(((0, 4),)), Replica(((0, 1), (1, 2), (2, 4)))), pipeline={"microbatches": 4}
        ),
    }
    others = {  # LoRA adapters (test_lora) and experts (test_moe) on 4 ranks, sharing this launch
        "LoRA dp2 x tp2 zero3": (tessera.Plan(tp=2, zero=3), "lora"),
        "LoRA dp2 x pp2": (tessera.Plan(pp=2, pipeline={"microbatches": 2}), "lora"),
        "LoRA tp2 x pp2 zero1": (tessera.Plan(tp=2, pp=2, zero=1, pipeline={"microbatches": 2}), "lora"),
        "MoE ep2 x dp2": (tessera.Plan(ep=2), "moe_llama"),
        "MoE ep2 x dp2 zero3": (tessera.Plan(ep=2, zero=3), "moe_llama"),
        "MoE tp2 x ep2": (tessera.Plan(tp=2, ep=2), "moe_llama"),  # attention split, experts split over ep
        "MoE pp2 x ep2, experts 1:3": (
            tessera.Plan(pp=2, ep=2, expert_shares=(1, 3), pipeline={"microbatches": 2}),
            "moe_llama_unbalanced",
        ),
        "MoE pp2 x ep2, 2 micro-batches": (
            tessera.Plan(pp=2, ep=2, pipeline={"microbatches": 2}),
            "moe_llama_unbalanced",
        ),
    }
    cases = [(name, plan.to_dict(), kind, None) for name, plan in plans.items()]
    cases += [(name, plan.to_dict(), model, None) for name, (plan, model) in others.items()]
    check_cases(4, cases, GLOBAL_BATCH, STEPS)


def _rewrite(path: Path, change) -> None:
    """Apply ``change`` to the tensors of the file holding the first layer's query weight."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.0.self_attn.q_proj.weight"
    file = path / index["weight_map"][name]
    tensors = load_file(str(file))
    change(tensors, name)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _copy(saved: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, tmp_path / "copy"))


def test_a_directory_with_no_weights_or_a_missing_shard_is_a_clear_error(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is not a directory"):
        empty_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no safetensors weights"):
        empty_pretrained(tmp_path / "empty")
    copy = _copy(saved, tmp_path)
    gone = sorted(copy.glob("*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(InputError, match=f"names 1 file\\(s\\) that are not in .*{gone.name}"):
        empty_pretrained(copy)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t, n: t.pop(n), r"missing \(1\): model.layers.0.self_attn.q_proj.weight"),
        (lambda t, n: t.update({n: t[n][:-1]}), r"mis-shaped \(1\): model.layers.0.self_attn.q_proj.weight: stored"),
        (lambda t, n: t.update({"model.extra.weight": t[n].clone()}), r"unexpected \(1\): model.extra.weight"),
    ],
    ids=["missing", "mis-shaped", "unexpected"],
)
def test_tensors_that_do_not_fit_the_config_are_listed_in_one_error(saved: Path, tmp_path: Path, change, message):
    copy = _copy(saved, tmp_path)
    _rewrite(copy, change)
    with pytest.raises(InputError, match=message):
        empty_pretrained(copy)


def test_tessera_train_loads_a_pretrained_directory_and_exports_it_back(tmp_path: Path) -> None:
    """`tessera train` with `model.pretrained` under ZeRO-3 on 2 ranks, then `tessera export --hf-dir`:
    transformers loads the export and gives the original's logits. SGD at lr 1e-30 moves no fp32 weight (a
    step of 1e-30 × gradient is below half an ulp of every weight), so the checkpoint holds what was loaded."""
    import subprocess
    import sys

    import yaml
    from test_checkpoint import tiny_config
    from transformers import AutoModelForCausalLM

    from tessera.models import hf

    torch.manual_seed(0)
    original = hf.llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=260, seq_len=32)
    source = _save(original, tmp_path / "source")
    (source / "tokenizer_config.json").write_text("{}")  # not the tokenizer trained with (bytes): not exported
    config = tiny_config(tmp_path / "runs", 2, 2, {"preset": "zero", "zero": 3})
    config["model"] = {"pretrained": str(source)}
    config["data"]["tokenizer"] = "bytes"  # the source has no tokenizer.json
    config["optimizer"] = {"name": "sgd", "lr": 1e-30, "momentum": 0.0, "weight_decay": 0.0}
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(config))

    def cli(*args: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    cli("train", str(tmp_path / "ft.yaml"), "--nproc", "2")
    from tessera.cli import main

    step = tmp_path / "runs" / "t" / "checkpoints" / "step_00000002"
    assert main(["export", str(step), "--hf-dir", str(tmp_path / "out")]) == 0  # in this process: no start-up
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    x = torch.randint(0, 260, (2, 16))
    assert torch.equal(exported(x).logits, original(x).logits)
    assert not (tmp_path / "out" / "tokenizer_config.json").exists()  # the export carries the run's tokenizer only


def test_a_pretrained_config_that_cannot_work_is_refused_before_anything_runs(saved: Path, tmp_path: Path) -> None:
    from test_checkpoint import tiny_config

    from tessera.config import ConfigError, parse_config
    from tessera.models.build import build_model as build_from_config

    def config(**model) -> dict:
        base = tiny_config(tmp_path, 2, 2, {"preset": "ddp"})
        return {**base, "model": model, "data": {**base["data"], "tokenizer": "bytes"}}

    with pytest.raises(ConfigError, match="no config.json in it"):
        parse_config(config(pretrained=str(tmp_path)))
    with pytest.raises(ConfigError, match="drop model.kind='llama'"):
        parse_config(config(pretrained=str(saved), kind="llama"))
    assert parse_config(config(pretrained=str(saved))).model.kind == "hf_pretrained"
    with pytest.raises(ConfigError, match="vocabulary of 128 tokens, but the data's tokenizer .* up to 255"):
        build_from_config(parse_config(config(pretrained=str(saved))))  # the parity model: 128 ids, bytes need 256


def test_bf16_weights_load_as_fp32_values(tmp_path: Path) -> None:
    """Checkpoints ship in bf16; the model trains in fp32: each value is the bf16 one, converted on read."""
    shipped = build_model("hf_llama").to(torch.bfloat16)
    shipped.save_pretrained(str(tmp_path / "bf16"), max_shard_size="20KB")
    model = _loaded(tmp_path / "bf16")
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, shipped.get_parameter(name).float()), name
