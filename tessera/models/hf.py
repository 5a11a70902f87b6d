"""Hugging Face models built from configs (no weights are downloaded): optional dependency.

Example:
    >>> model = gpt2(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, seq_len=128)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError("Hugging Face models need the optional dependency: pip install 'tessera[hf]'") from None


def gpt2_config(n_layer: int, n_embd: int, n_head: int, vocab_size: int, seq_len: int, dropout: float = 0.0) -> Any:
    """The ``GPT2Config`` of :func:`gpt2`."""
    _require_transformers()
    from transformers import GPT2Config

    return GPT2Config(
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


def gpt2(n_layer: int, n_embd: int, n_head: int, vocab_size: int, seq_len: int, dropout: float = 0.0) -> nn.Module:
    """A freshly initialised ``GPT2LMHeadModel``; dropout off by default so runs are comparable."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config(n_layer, n_embd, n_head, vocab_size, seq_len, dropout))


def _llama_like(
    config_cls: type,
    model_cls: type | None,
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
    return cfg if model_cls is None else model_cls(cfg)


def llama_config(
    n_layer: int, hidden: int, n_head: int, n_kv_head: int, ffn: int, vocab_size: int, seq_len: int
) -> Any:
    """The ``LlamaConfig`` of :func:`llama`."""
    _require_transformers()
    from transformers import LlamaConfig

    return _llama_like(LlamaConfig, None, n_layer, hidden, n_head, n_kv_head, ffn, vocab_size, seq_len)


def llama(n_layer: int, hidden: int, n_head: int, n_kv_head: int, ffn: int, vocab_size: int, seq_len: int) -> nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` (grouped-query attention when n_kv_head < n_head)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(n_layer, hidden, n_head, n_kv_head, ffn, vocab_size, seq_len))


def from_config(config: Any) -> nn.Module:
    """The causal LM class of ``config``'s family, freshly initialised from it (as its class would be built)."""
    _require_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def read_config(path: str) -> Any:
    """The Hugging Face config in a local ``config.json`` (or the folder holding it), refused with the path
    named when transformers cannot read it."""
    _require_transformers()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # transformers' ways of refusing a config
        raise _not_a_config(path, exc) from None


def from_config_file(path: str) -> nn.Module:
    """``AutoModelForCausalLM`` from a local ``config.json`` (or the folder holding it), freshly initialised."""
    from transformers import AutoModelForCausalLM

    config = read_config(path)
    try:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # not the config's saved dtype
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _not_a_config(path, exc) from None


def _not_a_config(path: str, exc: Exception) -> Exception:
    from tessera.inputs import InputError

    reason = " ".join(str(exc).split())[:300]
    return InputError(f"model.hf_config '{path}' is not a config transformers can build a causal LM from: {reason}")


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
