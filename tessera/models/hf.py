"""Hugging Face models built from configs (no weights are downloaded): optional dependency.

Example:
    >>> model = gpt2(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, seq_len=128)
"""

from __future__ import annotations

import torch
from torch import nn


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError("Hugging Face models need the optional dependency: pip install 'tessera[hf]'") from None


def gpt2(n_layer: int, n_embd: int, n_head: int, vocab_size: int, seq_len: int, dropout: float = 0.0) -> nn.Module:
    """A freshly initialised ``GPT2LMHeadModel``; dropout off by default so runs are comparable."""
    _require_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def _llama_like(
    config_cls: type,
    model_cls: type,
    n_layer: int,
    hidden: int,
    n_head: int,
    n_kv_head: int,
    ffn: int,
    vocab_size: int,
    seq_len: int,
    **extra: object,
) -> nn.Module:
    cfg = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv_head,
        max_position_embeddings=seq_len,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **extra,
    )
    return model_cls(cfg)


def llama(n_layer: int, hidden: int, n_head: int, n_kv_head: int, ffn: int, vocab_size: int, seq_len: int) -> nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` (grouped-query attention when n_kv_head < n_head)."""
    _require_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    return _llama_like(LlamaConfig, LlamaForCausalLM, n_layer, hidden, n_head, n_kv_head, ffn, vocab_size, seq_len)


def from_config_file(path: str) -> nn.Module:
    """``AutoModelForCausalLM`` from a local ``config.json`` (or the folder holding it), freshly initialised."""
    _require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    from tessera.inputs import InputError

    try:
        config = AutoConfig.from_pretrained(path)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # not the config's saved dtype
    except (OSError, ValueError, KeyError, TypeError) as exc:  # transformers' ways of refusing a config
        reason = " ".join(str(exc).split())[:300]
        raise InputError(
            f"model.hf_config '{path}' is not a config transformers can build a causal LM from: {reason}"
        ) from None


def qwen2(n_layer: int, hidden: int, n_head: int, n_kv_head: int, ffn: int, vocab_size: int, seq_len: int) -> nn.Module:
    """A freshly initialised ``Qwen2ForCausalLM`` (Llama-like, with q/k/v biases), untied embeddings."""
    _require_transformers()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _llama_like(
        Qwen2Config,
        Qwen2ForCausalLM,
        n_layer,
        hidden,
        n_head,
        n_kv_head,
        ffn,
        vocab_size,
        seq_len,
        tie_word_embeddings=False,
    )
