"""Build what a training config describes: the model (reference Llama or a Hugging Face family,
from sizes or a config file) and the optimizer. Used by the trainer, the pre-launch checks
(on the meta device), ``tessera plan`` and ``tessera export``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.data.text import ByteTokenizer
from tessera.data.tokenizer import HFTokenizer, load_tokenizer
from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS
from tessera.train.config import Config, ConfigError


def build_model(cfg: Config, weights: bool = True) -> nn.Module:
    """:func:`base_model`, with peft's LoRA adapters when ``model.lora`` is set (the base frozen)."""
    model = base_model(cfg, weights)
    if cfg.model.lora is None:
        return model
    from tessera.models.lora import with_lora

    lora = cfg.model.lora
    return with_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules)


def base_record(cfg: Config) -> dict[str, str]:
    """What a checkpoint holding LoRA adapters alone records of their base (``cfg.model.pretrained``)."""
    from tessera.models.pretrained import fingerprint

    assert cfg.model.pretrained is not None, "the config refuses checkpoint.base: false without model.pretrained"
    return {"pretrained": cfg.model.pretrained, "fingerprint": fingerprint(cfg.model.pretrained)}


def check_base_of(checkpoint: Path, cfg: Config) -> None:
    """Refuse a checkpoint holding LoRA adapters alone unless ``cfg`` reads the base they were trained on."""
    from tessera.checkpoint.readers import CheckpointError, read_meta
    from tessera.models.pretrained import check_same_base

    meta = read_meta(checkpoint)
    if meta.get("frozen", True) is True:
        return
    recorded = meta.get("base")
    if not isinstance(recorded, dict):
        raise CheckpointError(f"'{checkpoint / 'meta.json'}' is corrupted: it leaves the base out and names none.")
    check_same_base(recorded, cfg.model.pretrained, checkpoint)


def _moe_spec(moe: Any) -> Any:
    """The model's MoESpec from the config's ``model.moe`` (its fields, less the trainer's warning ones)."""
    from tessera.models.moe import MoESpec

    return MoESpec(**moe.model_dump(exclude={"warn_share", "warn_steps"}))


def base_model(cfg: Config, weights: bool = True) -> nn.Module:
    """The model ``cfg.model`` describes, with the tokenizer's vocabulary and ``data.seq_len`` positions (a
    model from a config or pretrained: its own, checked to hold every id the tokenizer gives; pretrained
    parameters stay on meta until the Booster lays the model out and loads them; ``weights=False``:
    freshly initialised from that config instead, for callers that load a checkpoint's weights into it or
    only time it)."""
    m, seq = cfg.model, cfg.data.seq_len
    tokenizer = tokenizer_for(cfg)
    vocab = tokenizer.vocab_size
    named = f"data.tokenizer '{cfg.data.tokenizer}'" if cfg.data.tokenizer not in (None, "bytes") else None
    if m.kind == "llama":
        from tessera.models import Llama, LlamaConfig

        return Llama(
            LlamaConfig(
                vocab_size=vocab,
                dim=m.dim,
                n_layers=m.n_layers,
                n_heads=m.n_heads,
                n_kv_heads=m.n_kv_heads,
                ffn_dim=m.ffn_dim,
                max_seq_len=seq,
                tie_embeddings=m.tie_embeddings,
                moe=None if m.moe is None else _moe_spec(m.moe),
            )
        )
    from tessera.models import hf

    if m.kind == "hf_pretrained":
        from tessera.models.pretrained import empty_pretrained

        # parameters on meta: the runtime loads each rank's slices once laid out
        model = empty_pretrained(m.pretrained) if weights else hf.from_config_file(m.pretrained)
        named = named or ("its own tokenizer" if not cfg.data.tokenizer else None)
        check_vocabulary(model, vocab, f"model.pretrained '{m.pretrained}'", named)
        return model
    if m.kind == "hf_config":
        model = hf.from_config_file(m.hf_config)
        check_vocabulary(model, vocab, f"model.hf_config '{m.hf_config}'", named)
        return model
    if m.kind == "hf_gpt2":
        return hf.gpt2(n_layer=m.n_layers, n_embd=m.dim, n_head=m.n_heads, vocab_size=vocab, seq_len=seq)
    return hf.llama(
        n_layer=m.n_layers,
        hidden=m.dim,
        n_head=m.n_heads,
        n_kv_head=m.n_kv_heads,
        ffn=m.ffn_dim,
        vocab_size=vocab,
        seq_len=seq,
    )


def tokenizer_for(cfg: Config) -> ByteTokenizer | HFTokenizer:
    """The tokenizer ``data.tokenizer`` names; unset: the one ``data.prepared`` was tokenized with, else a
    pretrained model's own, else bytes. With prepared data a named one must have the same vocabulary."""
    d = cfg.data
    if d.prepared is None:
        return load_tokenizer(d.tokenizer, cfg.model.pretrained)
    from tessera.data.shards import read_index

    index = read_index(d.prepared)
    kept = "bytes" if index["tokenizer"] == "bytes" else str(Path(d.prepared) / index["tokenizer"])
    tokenizer = load_tokenizer(d.tokenizer or kept)
    if tokenizer.vocab_size != index["vocab_size"]:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but data.prepared '{d.prepared}' was tokenized with "
            f"{index['vocab_size']}: leave data.tokenizer unset (the prepared folder's own is used)."
        )
    return tokenizer


def check_vocabulary(model: nn.Module, tokens: int, source: str, tokenizer: str | None = None) -> None:
    """Refuse a model whose embedding has fewer rows than the tokenizer has ids, before any step would
    index past it."""
    rows = model.get_input_embeddings().num_embeddings
    if rows < tokens:
        raise ConfigError(
            f"{source} has a vocabulary of {rows} tokens, but the data's tokenizer ({tokenizer or 'bytes'}) gives "
            f"ids up to {tokens - 1}: use a model with at least {tokens} embeddings, or a tokenizer that fits it."
        )


def build_optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names, over ``params``."""
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "lamb":
        return LAMB(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    if o.name == "lars":
        return LARS(
            params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, trust_coefficient=o.trust_coefficient
        )
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
