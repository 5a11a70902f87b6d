"""``tessera train`` does each thing once per process: the launcher parses the config once and resolves its
plan once, builds no model (a plan with tp, sp or pp builds one on meta, to check its shapes), and tokenizes
the instruction records once for the whole job (its ranks read them from the file it hands on); each rank
parses the config once, resolves the plan once and builds the model once. Counted by wrapping the functions
that do each."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from test_checkpoint import tiny_config

COUNTED = {
    "parses": ("tessera.config", "parse_config"),
    "resolutions": ("tessera.plan.grid", "resolve"),
}
BUILT = {
    "models": ("tessera.models.llama", "Llama"),
    "instruction sets": ("tessera.data.instructions", "InstructionData"),
    "text sets": ("tessera.data.text", "PackedText"),
}


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Counts of parses, plan resolutions and builds of models and datasets while inside."""
    import importlib

    counts = dict.fromkeys([*COUNTED, *BUILT], 0)
    undo = []

    def counted(name: str, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, (module, attr) in COUNTED.items():
        owner = importlib.import_module(module)
        original = getattr(owner, attr)
        setattr(owner, attr, counted(name, original))
        undo.append(lambda owner=owner, attr=attr, original=original: setattr(owner, attr, original))
    for name, (module, attr) in BUILT.items():
        cls = getattr(importlib.import_module(module), attr)
        init = cls.__init__
        cls.__init__ = counted(name, init)
        undo.append(lambda cls=cls, init=init: setattr(cls, "__init__", init))
    try:
        yield counts
    finally:
        for restore in undo:
            restore()


def rank_counts(rank_args: list[str]) -> dict[str, int]:
    """One rank of the job, as torchrun would start it (``python -m tessera.train.run ...``), counted."""
    from tessera.train.run import main

    with counting() as counts:
        assert main(rank_args) == 0
    return counts


def _config(tmp_path: Path, instructions: bool) -> Path:
    config = tiny_config(tmp_path / "runs", 2, 2, {"preset": "zero", "zero": 1})
    if instructions:
        records = tmp_path / "sft.jsonl"
        lines = [json.dumps({"prompt": f"say {i}: ", "response": f"{i} " * (1 + i % 3)}) for i in range(16)]
        records.write_text("\n".join(lines) + "\n")
        config["data"] = {"instructions": [str(records)], "seq_len": 32}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("instructions", [False, True], ids=["text", "instructions"])
def test_each_process_parses_resolves_and_builds_once(
    instructions: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tessera.cli import main
    from tessera.testing import run_ranks

    ranks: list[dict[str, int]] = []
    handed: list[str] = []

    def launch(job) -> int:  # the job's ranks run here, with what the launcher hands them
        handed.extend(job.env.values())
        with monkeypatch.context() as env:
            for key, value in (job.env or {}).items():
                env.setenv(key, value)
            assert job.module == "tessera.train.run"
            ranks.extend(run_ranks(rank_counts, 2, job.rank_args, timeout_s=240))
        return 0

    monkeypatch.setattr("tessera.launch.commands.launch", launch)
    config = _config(tmp_path, instructions)
    with counting() as launcher:
        assert main(["train", str(config), "--nproc", "2"]) == 0
    assert launcher == {"parses": 1, "resolutions": 1, "models": 0, "instruction sets": int(instructions),
                        "text sets": 0}, launcher  # fmt: skip
    assert len(ranks) == 2
    for counts in ranks:  # the records were tokenized once, by the launcher: the ranks read its file
        assert counts == {"parses": 1, "resolutions": 1, "models": 1, "instruction sets": 0,
                          "text sets": int(not instructions)}, counts  # fmt: skip
    assert len(handed) == int(instructions) and not any(Path(p).exists() for p in handed)  # removed after the launch


def _hf_configs() -> list:
    from transformers import MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config

    from tessera.models import hf

    small = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 300}  # fmt: skip
    return [
        hf.llama_config(2, 32, 4, 2, 48, 300, 16),
        hf.gpt2_config(2, 32, 4, 300, 16),
        Qwen2Config(**small),
        Qwen3Config(**small, head_dim=16),
        MistralConfig(**small, tie_word_embeddings=True),
        MixtralConfig(**small, num_local_experts=3),
    ]


def test_the_launcher_counts_parameters_from_sizes_as_the_built_model_has_them(tmp_path: Path) -> None:
    """The memory estimate before launch counts from the description (no model is built): equal to the built
    model's parameters for the reference Llama (dense, tied, experts with a shared one), each Hugging Face
    family counted, and a pretrained directory (its headers; a tied weight stored once)."""
    import torch

    from tessera.models import Llama, LlamaConfig, hf
    from tessera.models.moe import MoESpec
    from tessera.models.size import hf_parameters, llama_parameters, pretrained_parameters

    def built(model: torch.nn.Module) -> int:
        return sum(p.numel() for p in model.parameters())

    with torch.device("meta"):
        for config in (LlamaConfig(), LlamaConfig(tie_embeddings=True, n_kv_heads=1),
                       LlamaConfig(moe=MoESpec(experts=4, top_k=2, shared_expert=True, hidden=24))):  # fmt: skip
            assert llama_parameters(config) == built(Llama(config)), config
        for config in _hf_configs():
            assert hf_parameters(config) == built(hf.from_config(config)), config.model_type
    assert llama_parameters(LlamaConfig(vocab_size=256, dim=64, n_layers=2)) == 106816  # the module's example
    tied = hf.gpt2(n_layer=1, n_embd=32, n_head=4, vocab_size=300, seq_len=16)
    tied.save_pretrained(tmp_path / "gpt2")
    assert pretrained_parameters(tmp_path / "gpt2") == built(tied)
