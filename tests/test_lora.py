"""LoRA through peft (issue 15, item 5): a peft-wrapped model boosts under DDP and ZeRO-1/2/3 and trains
like peft on one process; the base weights get no gradients and no optimizer state and stay as loaded;
`tessera export --hf-dir` folds the adapters into a full Hugging Face directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from parity import check_cases, run_shared
from test_data_parallel_parity import PRESETS

import tessera
from tessera.errors import PlanError
from tessera.inputs import InputError

PLANS = {name: PRESETS[name] for name in ("ddp", "zero1", "zero2", "zero3")}
SPLIT_PLANS = {  # the adapted projections split as their base layers are (tessera.models.policies.through_peft)
    "tp2": tessera.Plan(tp=2),
    "tp2 split-gather sp": tessera.Plan(tp=2, sp=2, sp_mode="split_gather"),
    "pp2": tessera.Plan(pp=2, pipeline={"microbatches": 2}),
    "Ulysses sp2": tessera.Plan(sp=2),
}


def test_lora_trains_like_peft_on_one_process_in_every_layout() -> None:
    """DDP, ZeRO-1/2/3, tp2 (adapters on column- and row-parallel projections), tp2 with split/gather sequence
    parallelism, pp2, Ulysses sp2: losses, norms, the adapters' first gradients (the frozen weights have none:
    checked on every rank), all parameters after 3 AdamW steps and the forward-only loss: 1e-5. dp × tp, dp ×
    pp and tp × pp on 4 ranks: test_pretrained."""
    plans = {**PLANS, **SPLIT_PLANS}
    check_cases(2, [(name, plan.to_dict(), "lora", None) for name, plan in plans.items()], 8, 3)


def _optimizer_state(plan_dict: dict) -> dict:
    from parity import build_model

    model = build_model("lora")
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = booster.boost(model, torch.optim.AdamW(trainable, lr=1e-3))
    x = torch.randint(0, 128, (4, 16))
    booster.execute_pipeline((x, x), model, lambda out, y: torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), y.flatten()), optimizer)  # fmt: skip
    optimizer.step()
    return {
        "trainable": sum(p.requires_grad for p in model.parameters()),
        "frozen": sum(not p.requires_grad for p in model.parameters()),
        "state_bytes": int(tessera.memory.model_state_bytes(model, optimizer)),
        "stepped": sum(1 for g in optimizer.param_groups for p in g["params"]),
    }


def test_only_the_adapters_are_optimised() -> None:
    got = run_shared(2, {name: (_optimizer_state, (plan.to_dict(),)) for name, plan in PLANS.items()})
    for name, ranks in got.items():
        assert all(r["stepped"] == r["trainable"] == 16 and r["frozen"] > 16 for r in ranks), (name, ranks)


@pytest.mark.parametrize(
    "lora, message",
    [
        ({"lora_dropout": 0.1}, "LoRA dropout would drop different features on each tp rank"),
        ({"target_modules": ["q_proj", "lm_head"]}, "LoRA on lm_head with tensor parallelism .* is not supported"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "LoRA on model.embed_tokens with tensor parallelism"),
        ({"use_dora": True}, "variants \\(DoRA and others\\) are not supported"),
    ],
)
def test_what_tensor_parallel_adapters_cannot_do_is_refused_by_name(lora: dict, message: str) -> None:
    from peft import LoraConfig, get_peft_model

    from tessera.models import hf
    from tessera.models.policies import policy_for

    model = get_peft_model(hf.llama(n_layer=1, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=128, seq_len=16),
                           LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **lora}))  # fmt: skip
    with pytest.raises(PlanError, match=message):
        policy_for(model).tensor_plan(model)


def test_lora_dropout_under_tensor_parallelism_is_refused_before_launch(tmp_path: Path) -> None:
    from test_checkpoint import tiny_config

    from tessera.config import ConfigError
    from tessera.launch.preflight import check_training

    config = tiny_config(tmp_path / "runs", 2, 2, {"tp": 2}, kind="hf_llama")
    config["model"]["lora"] = {"dropout": 0.1}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"model.lora.dropout=0.1 with plan.tp=2: .* set model.lora.dropout: 0"):
        check_training(str(tmp_path / "c.yaml"), [], 2, 1, overwrite=True)


def test_pretrained_lora_checkpoints_the_adapters_alone_resumes_them_and_exports_them_merged(tmp_path: Path) -> None:
    """`tessera train` with `model.pretrained` and `model.lora` under ZeRO-3 on 2 ranks, 4 steps, checkpoints at 2
    and 4: they hold the adapters alone (no base weight). Resumed from step 2 under tp2, the run ends at the
    same adapters (1e-5). The export is a full Hugging Face model whose weights outside q_proj and v_proj are
    the pretrained ones, bit for bit, and whose q_proj and v_proj are the pretrained ones plus the trained
    adapters (alpha/r · B·A). A base with other values is refused before launch."""
    from safetensors.torch import load_file
    from test_checkpoint import tiny_config
    from transformers import AutoModelForCausalLM

    from tessera.export import load_full_model_state
    from tessera.launch.preflight import check_training
    from tessera.models import hf

    torch.manual_seed(0)
    original = hf.llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=260, seq_len=32)
    original.save_pretrained(str(tmp_path / "source"), max_shard_size="40KB")
    config = tiny_config(tmp_path / "runs", 4, 2, {"preset": "zero", "zero": 3})
    config["model"] = {"pretrained": str(tmp_path / "source"), "lora": {"r": 4, "alpha": 8}}
    config["data"]["tokenizer"] = "bytes"
    config["optimizer"] = {"name": "adamw", "lr": 1e-2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))

    def cli(*args: str) -> None:
        proc = subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    cli("train", str(tmp_path / "c.yaml"), "--nproc", "2")
    checkpoints = tmp_path / "runs" / "t" / "checkpoints"
    step = checkpoints / "step_00000004"
    straight = load_full_model_state(step)
    assert len(straight) == 8 and all(".lora_" in name for name in straight), sorted(straight)  # q, v: A, B
    shutil.rmtree(step)  # resume from step 2, under tensor parallelism
    config["plan"] = {"tp": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cli("train", str(tmp_path / "c.yaml"), "--nproc", "2")
    state = load_full_model_state(step)
    assert state.keys() == straight.keys()
    for name, value in straight.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")

    from tessera.cli import main

    assert main(["export", str(step), "--hf-dir", str(tmp_path / "out")]) == 0  # in this process: no start-up
    exported = {}
    for file in (tmp_path / "out").glob("*.safetensors"):
        exported.update(load_file(str(file)))
    source = original.state_dict()
    assert exported.keys() == source.keys()
    for name, weight in source.items():
        if ".q_proj." in name or ".v_proj." in name:
            prefix = "base_model.model." + name.removesuffix(".weight")
            a, b = state[f"{prefix}.lora_A.default.weight"], state[f"{prefix}.lora_B.default.weight"]
            assert b.abs().max() > 0, "the adapters trained"
            torch.testing.assert_close(exported[name], weight + (8 / 4) * b @ a, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(exported[name], weight), f"{name} moved: the base is frozen"
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    x = torch.randint(0, 260, (2, 16))
    assert not torch.equal(merged(x).logits, original(x).logits)

    torch.manual_seed(1)  # same shapes, other values: not the base the adapters were trained on
    hf.llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=260, seq_len=32).save_pretrained(
        str(tmp_path / "source"), max_shard_size="40KB"
    )
    with pytest.raises(InputError, match="holds LoRA adapters trained on the weights in .* holds other weights"):
        check_training(str(tmp_path / "c.yaml"), [], 2, 1, False)


def test_adapters_on_a_meta_base_get_peft_s_initialisation_and_keep_it_through_materialize(tmp_path: Path) -> None:
    """On a pretrained model still on meta, the adapters are real at once, by peft's own initialisation (B
    zero, A uniform within kaiming's bound), the same for the same seed (so on every rank), and kept when
    the runtime gives the base memory and reads it."""
    import math

    from tessera.models import hf
    from tessera.models.lora import with_lora
    from tessera.models.pretrained import empty_pretrained, load_into, materialize, source_of

    base = hf.llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=260, seq_len=32)
    base.save_pretrained(str(tmp_path / "src"))

    def adapters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p for n, p in model.named_parameters() if ".lora_" in n}

    torch.manual_seed(3)
    again = {n: p.detach().clone() for n, p in adapters_of(with_lora(empty_pretrained(tmp_path / "src"))).items()}
    torch.manual_seed(3)
    model = with_lora(empty_pretrained(tmp_path / "src"))
    adapters = adapters_of(model)
    assert len(adapters) == 8 and all(not p.is_meta for p in adapters.values())
    for name, p in adapters.items():
        assert torch.equal(p, again[name]), name  # every rank draws the same
        if "lora_B" in name:
            assert torch.count_nonzero(p) == 0
        else:  # kaiming_uniform_(a=sqrt(5)) over 32 inputs: within 1/sqrt(32), and not all zero
            assert 0 < p.abs().max() <= 1 / math.sqrt(32)
    before = {n: p.detach().clone() for n, p in adapters.items()}
    materialize(model, torch.device("cpu"))
    load_into(model, source_of(model))
    weights = base.state_dict()
    for name, p in model.named_parameters():
        want = before[name] if name in before else weights[name.removeprefix("base_model.model.").replace(
            ".base_layer.", ".")]  # fmt: skip
        assert torch.equal(p, want), name
