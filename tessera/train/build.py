"""Build what a training config describes: the model (reference Llama or a Hugging Face family,
from sizes or a config file) and the optimizer. Used by the trainer, the pre-launch checks
(on the meta device), ``tessera plan`` and ``tessera export``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.data.text import ByteTokenizer
from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS
from tessera.train.config import Config, ConfigError


def build_model(cfg: Config, weights: bool = True) -> nn.Module:
    """The model ``cfg.model`` describes, with a byte-level vocabulary and ``data.seq_len`` positions (a
    pretrained one: its own config's, with its parameters on meta until the Booster lays it out and loads
    them; ``weights=False``: freshly initialised from that config instead, for callers that load a
    checkpoint's weights into it or only time it)."""
    m, seq = cfg.model, cfg.data.seq_len
    vocab = ByteTokenizer.vocab_size
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
            )
        )
    from tessera.models import hf

    if m.kind == "hf_pretrained":
        from tessera.models.pretrained import empty_pretrained

        # parameters on meta: the runtime loads each rank's slices once laid out
        model = empty_pretrained(m.pretrained) if weights else hf.from_config_file(m.pretrained)
        check_vocabulary(model, vocab, f"model.pretrained '{m.pretrained}'")
        return model
    if m.kind == "hf_config":
        return hf.from_config_file(m.hf_config)
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


def check_vocabulary(model: nn.Module, tokens: int, source: str) -> None:
    """Refuse a model whose embedding has fewer rows than the tokenizer has ids, before any step would
    index past it."""
    rows = model.get_input_embeddings().num_embeddings
    if rows < tokens:
        raise ConfigError(
            f"{source} has a vocabulary of {rows} tokens, but the data's tokenizer (bytes) gives ids up to "
            f"{tokens - 1}: use a model with at least {tokens} embeddings."
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
