"""Build the model a training config describes (:mod:`tessera.models.described`): the reference Llama or a
Hugging Face family, from sizes, a config file or pretrained files, with LoRA adapters when asked. Used by the
trainer, the launcher's checks (on the meta device), ``tessera plan``, ``tessera export``, ``tessera merge``
and the profiler's job."""

from __future__ import annotations

from torch import nn

from tessera.config import Config
from tessera.models import hf
from tessera.models.described import hf_config, llama_config, tokenizer_for, vocabulary_source
from tessera.models.llama import Llama
from tessera.models.size import check_vocabulary


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
