"""Policy for Hugging Face ``LlamaForCausalLM`` (and families with the same module names)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tessera.models.policies.base import Policy


def _is_hf_llama(model: nn.Module) -> bool:
    return type(model).__name__ in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


HF_LLAMA = Policy(
    name="Hugging Face Llama",
    matches=_is_hf_llama,
    sizes=lambda m: {
        "num_attention_heads": m.config.num_attention_heads,
        "num_key_value_heads": m.config.num_key_value_heads,
        "intermediate_size": m.config.intermediate_size,
        "vocab_size": m.config.vocab_size,
    },
    tp_plan=lambda m: {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    },
    tied_embeddings=lambda m: bool(getattr(m.config, "tie_word_embeddings", False)),
)
