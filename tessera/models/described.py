"""The model a training config describes, without building it: the tokenizer it reads with, its configs, its
parameter count and a check of its vocabulary against the tokenizer's.

The launcher's checks ask here (no model is built before launch); the ranks' builder
(:mod:`tessera.models.build`) builds from the same descriptions, so both see one model.

Example:
    >>> parameter_count(load_config("examples/demo.yaml"), vocab=256)   # the demo's reference Llama
    853120
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessera.config import Config, ConfigError
from tessera.data.shards import read_index
from tessera.data.text import ByteTokenizer
from tessera.data.tokenizer import HFTokenizer, load_tokenizer
from tessera.models import hf
from tessera.models.llama import LlamaConfig
from tessera.models.moe import MoESpec
from tessera.models.size import check_vocabulary, hf_parameters, llama_parameters, pretrained_parameters


def tokenizer_for(cfg: Config) -> ByteTokenizer | HFTokenizer:
    """The tokenizer the config reads with: ``data.tokenizer``; unset, the one ``data.prepared`` was tokenized
    with, else a pretrained model's own, else bytes. With prepared data a named one must have the same
    vocabulary."""
    d = cfg.data
    if d.prepared is None:
        return load_tokenizer(d.tokenizer, cfg.model.pretrained)
    index = read_index(d.prepared)
    kept = "bytes" if index["tokenizer"] == "bytes" else str(Path(d.prepared) / index["tokenizer"])
    tokenizer = load_tokenizer(d.tokenizer or kept)
    if tokenizer.vocab_size != index["vocab_size"]:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but data.prepared '{d.prepared}' was tokenized with "
            f"{index['vocab_size']}: leave data.tokenizer unset (the prepared folder's own is used)."
        )
    return tokenizer


def llama_config(cfg: Config, vocab: int) -> LlamaConfig:
    """The reference Llama's config: ``model``'s sizes, ``vocab`` tokens, ``data.seq_len`` positions."""
    m = cfg.model
    return LlamaConfig(
        vocab_size=vocab,
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        ffn_dim=m.ffn_dim,
        max_seq_len=cfg.data.seq_len,
        tie_embeddings=m.tie_embeddings,
        moe=None if m.moe is None else MoESpec(**m.moe.model_dump(exclude={"warn_share", "warn_steps"})),
    )


def hf_config(cfg: Config, vocab: int) -> Any:
    """The Hugging Face config of an ``hf_`` model kind (read from its file for ``hf_config`` and
    ``hf_pretrained``: a file transformers cannot read is refused naming it)."""
    m, seq = cfg.model, cfg.data.seq_len
    if m.kind == "hf_gpt2":
        return hf.gpt2_config(n_layer=m.n_layers, n_embd=m.dim, n_head=m.n_heads, vocab_size=vocab, seq_len=seq)
    if m.kind == "hf_llama":
        return hf.llama_config(m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, vocab, seq)
    return hf.read_config(m.hf_config if m.kind == "hf_config" else m.pretrained)


def vocabulary_source(cfg: Config) -> tuple[str, str | None]:
    """How errors name a model with a vocabulary of its own, and the data's tokenizer."""
    m, tokenizer = cfg.model, cfg.data.tokenizer
    named = f"data.tokenizer '{tokenizer}'" if tokenizer not in (None, "bytes") else None
    if m.kind == "hf_pretrained":
        return f"model.pretrained '{m.pretrained}'", named or ("its own tokenizer" if not tokenizer else None)
    return f"model.hf_config '{m.hf_config}'", named


def parameter_count(cfg: Config, vocab: int) -> int:
    """Parameters of the base model ``cfg.model`` describes with ``vocab`` tokens (LoRA adapters, a rounding
    error beside it, not counted), checking on the way that a model of its own vocabulary holds every id the
    tokenizer gives. Counted from the sizes; a Hugging Face family :mod:`tessera.models.size` does not count
    is built on the meta device (shapes only) to be counted."""
    m = cfg.model
    if m.kind == "llama":
        return llama_parameters(llama_config(cfg, vocab))
    config = hf_config(cfg, vocab)
    if m.kind in ("hf_config", "hf_pretrained"):
        check_vocabulary(config.vocab_size, vocab, *vocabulary_source(cfg))
    if m.kind == "hf_pretrained":
        return pretrained_parameters(m.pretrained)
    counted = hf_parameters(config)
    return counted if counted is not None else _counted_on_meta(config)


def _counted_on_meta(config: Any) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
