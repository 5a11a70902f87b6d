"""Build what a training config describes (:mod:`tessera.models.described`): the model (reference Llama
or a Hugging Face family, from sizes, a config file or pretrained files) and the optimizer. Used by the
trainer, ``tessera plan``, ``tessera export``, ``tessera merge`` and the profiler's job."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.config import Config
from tessera.models import hf
from tessera.models.described import hf_config, llama_config, tokenizer_for, vocabulary_source
from tessera.models.llama import Llama
from tessera.models.size import check_vocabulary
from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS


def build_model(cfg: Config, weights: bool = True) -> nn.Module:
    """:func:`base_model`, with peft's LoRA adapters when ``model.lora`` is set (the base frozen)."""
    model = base_model(cfg, weights)
    if cfg.model.lora is None:
        return model
    from tessera.models.lora import with_lora  # peft: an optional dependency

    lora = cfg.model.lora
    return with_lora(model, lora.r, lora.alpha, lora.dropout, lora.target_modules)


def base_model(cfg: Config, weights: bool = True) -> nn.Module:
    """The model ``cfg.model`` describes, with the tokenizer's vocabulary and ``data.seq_len`` positions (a
    model from a config or pretrained: its own, checked to hold every id the tokenizer gives; pretrained
    parameters stay on meta until the Booster lays the model out and loads them; ``weights=False``:
    freshly initialised from that config instead, for callers that load a checkpoint's weights into it or
    only time it)."""
    m = cfg.model
    vocab = tokenizer_for(cfg).vocab_size
    if m.kind == "llama":
        return Llama(llama_config(cfg, vocab))
    if m.kind in ("hf_gpt2", "hf_llama"):  # sized by the config, to the tokenizer
        return hf.from_config(hf_config(cfg, vocab))
    if m.kind == "hf_pretrained" and weights:
        from tessera.models.pretrained import empty_pretrained

        model = empty_pretrained(m.pretrained)  # parameters on meta: the runtime loads each rank's slices
    else:
        model = hf.from_config_file(m.pretrained if m.kind == "hf_pretrained" else m.hf_config)
    check_vocabulary(model.get_input_embeddings().num_embeddings, vocab, *vocabulary_source(cfg))
    return model


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
