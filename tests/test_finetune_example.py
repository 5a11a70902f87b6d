"""`examples/finetune_llama.yaml` end to end, without any hub (issue 15, item 6): a tiny random Llama saved
with save_pretrained in shards, a tokenizer trained here on local text with a chat template, instruction
data generated here; LoRA under ZeRO-2 on 2 ranks, held-out loss, then `tessera export`: a Hugging Face
directory (adapters merged, the tokenizer's every file), the same merged weights as safetensors, and a PEFT
adapter folder that peft loads onto the base (issue 33, item 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from local_tokenizer import END, train_tokenizer

EXAMPLE = Path(__file__).parent.parent / "examples" / "finetune_llama.yaml"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + END + "{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")  # fmt: skip


def test_the_fine_tuning_example_runs_end_to_end_and_exports_a_hugging_face_model(tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from tessera.models import hf

    model_dir = tmp_path / "llama"
    # The model's own tokenizer beside its weights, saved as current transformers saves one: the chat
    # template in chat_template.jinja, not in tokenizer_config.json.
    trained = PreTrainedTokenizerFast(tokenizer_file=str(train_tokenizer(tmp_path / "tok", vocab_size=400)))
    trained.eos_token, trained.chat_template = END, TEMPLATE
    trained.save_pretrained(str(model_dir))
    assert (model_dir / "chat_template.jinja").read_text() == TEMPLATE
    assert "chat_template" not in json.loads((model_dir / "tokenizer_config.json").read_text())
    torch.manual_seed(0)
    original = hf.llama(n_layer=2, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=400, seq_len=64)
    original.save_pretrained(str(model_dir), max_shard_size="40KB")
    records = []
    for i in range(200):
        a, b = i % 7, (i * 3) % 5
        if i % 2:
            records.append({"prompt": f"What is {a} plus {b}? ", "response": f"{a + b}."})
        else:
            records.append({"messages": [{"role": "user", "content": f"Add {a} and {b}."},
                                         {"role": "assistant", "content": f"It is {a + b}."}]})  # fmt: skip
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    settings = {
        "model.pretrained": str(model_dir), "data.instructions": f"[{tmp_path / 'train.jsonl'}]",
        "data.seq_len": 64, "data.validation": 0.2, "train.steps": 6, "train.global_batch_size": 8,
        "eval.every": 3, "eval.batches": 1, "checkpoint.every": 6, "schedule.warmup_steps": 2,
        "logging.out_dir": str(tmp_path / "runs"), "logging.progress": "false",
    }  # fmt: skip
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]

    def cli(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    printed = cli("train", str(EXAMPLE), "--nproc", "2", *overrides)
    adapters = 2 * 8 * ((32 + 32) + (32 + 16) + (32 + 16) + (32 + 32))  # 2 layers, r=8 on q, k, v (2 KV heads), o
    assert f"trainable {adapters:,} (" in printed, printed[-2000:]
    run = tmp_path / "runs" / "finetune"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in held] == [3, 6] and all(r["val_perplexity"] > 1 for r in held)
    out, adapter, merged = tmp_path / "out", tmp_path / "adapter", tmp_path / "merged.safetensors"
    step = run / "checkpoints" / "step_00000006"
    from tessera.cli import main

    assert main(["export", str(step), "--hf-dir", str(out), "--adapter-dir", str(adapter), "--out", str(merged)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    assert (out / "chat_template.jinja").read_text() == TEMPLATE  # every tokenizer file travelled with it
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Add 1 and 2."}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)  # fmt: skip
    assert exported(prompt["input_ids"]).logits.shape[-1] == 400
    moved = {n for n, w in exported.state_dict().items() if not torch.equal(w, original.state_dict()[n])}
    assert moved and all(any(p in n for p in ("q_proj", "k_proj", "v_proj", "o_proj")) for n in moved), moved
    flat = load_file(str(merged))  # --out: the same merged model, by its base's names
    assert flat.keys() == exported.state_dict().keys()
    assert all(torch.equal(flat[n], w) for n, w in exported.state_dict().items())
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    base, x = AutoModelForCausalLM.from_pretrained(str(model_dir)), prompt["input_ids"]
    before = base(x).logits
    with_adapters = PeftModel.from_pretrained(base, str(adapter))  # peft's own loader, onto the base
    torch.testing.assert_close(with_adapters(x).logits, exported(x).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(with_adapters(x).logits, before, atol=1e-5)  # the adapters count
