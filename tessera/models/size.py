"""A model's parameter count and vocabulary from its description alone, without building it.

The launcher checks that a model fits this machine before any rank starts; the ranks then build the
model once. So the launcher counts from the sizes: the reference Llama's config, a Hugging Face
config (Llama, Mistral, Qwen2/3, Mixtral, GPT-2: the families counted here; another family is built on
the meta device to be counted), or a pretrained directory's weight-file headers. The counts equal
``sum(p.numel() for p in model.parameters())`` of the built model (tests compare them).

Example:
    >>> llama_parameters(LlamaConfig(vocab_size=256, dim=64, n_layers=2))
    106816
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tessera.config import ConfigError
from tessera.models.llama import LlamaConfig
from tessera.models.pretrained import stored_shapes, weight_files

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral")


def llama_parameters(config: LlamaConfig) -> int:
    """Parameters of :class:`~tessera.models.llama.Llama` with ``config`` (tied embeddings counted once)."""
    d, kv = config.dim, config.n_kv_heads * config.head_dim
    attention = 2 * d * config.n_heads * config.head_dim + 2 * d * kv
    moe = config.moe
    if moe is not None and moe.experts:
        hidden = moe.hidden or config.ffn_dim
        feed_forward = d * moe.experts + moe.experts * 3 * d * hidden + (3 * d * hidden if moe.shared_expert else 0)
    else:
        feed_forward = 3 * d * config.ffn_dim
    layers = config.n_layers * (attention + feed_forward + 2 * d)
    embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return embeddings + layers + d


def hf_parameters(config: Any) -> int | None:
    """Parameters of the causal LM a Hugging Face ``config`` describes, or None for a family not counted here."""
    kind = getattr(config, "model_type", None)
    if kind == "gpt2":
        return _gpt2(config)
    if kind not in LLAMA_LIKE:
        return None
    d, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head = getattr(config, "head_dim", None) or d // heads
    q, kv = heads * head, kv_heads * head
    biased = kind == "qwen2" or getattr(config, "attention_bias", False)  # q, k, v (and o, but for Qwen2)
    attention = 2 * d * q + 2 * d * kv + ((q + 2 * kv + (d if kind != "qwen2" else 0)) if biased else 0)
    if kind == "qwen3":
        attention += 2 * head  # q_norm, k_norm
    ffn = config.intermediate_size
    mlp = 3 * d * ffn + ((2 * ffn + d) if getattr(config, "mlp_bias", False) else 0)
    if kind == "mixtral":
        experts = config.num_local_experts
        mlp = d * experts + experts * 3 * d * ffn
    layers = config.num_hidden_layers * (attention + mlp + 2 * d)
    tied = getattr(config, "tie_word_embeddings", False)
    return config.vocab_size * d * (1 if tied else 2) + layers + d


def _gpt2(config: Any) -> int:
    d, inner = config.n_embd, config.n_inner or 4 * config.n_embd
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * inner + inner) + (inner * d + d)
    tied = getattr(config, "tie_word_embeddings", True)
    return config.vocab_size * d * (1 if tied else 2) + config.n_positions * d + config.n_layer * block + 2 * d


def pretrained_parameters(path: str | Path) -> int:
    """Parameters stored in a ``save_pretrained`` directory (from its weight files' headers; a tied weight
    is stored once, as the model holds it once)."""
    return sum(math.prod(shape) for shape in stored_shapes(weight_files(path)).values())


def check_vocabulary(rows: int, tokens: int, source: str, tokenizer: str | None = None) -> None:
    """Refuse an embedding of ``rows`` rows (``source`` names its model) when the tokenizer gives ``tokens``
    ids, before any step would index past it."""
    if rows < tokens:
        raise ConfigError(
            f"{source} has a vocabulary of {rows} tokens, but the data's tokenizer ({tokenizer or 'bytes'}) gives "
            f"ids up to {tokens - 1}: use a model with at least {tokens} embeddings, or a tokenizer that fits it."
        )
