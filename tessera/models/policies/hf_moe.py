"""Policy for Hugging Face's mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

They are Llama-shaped (the same attention, decoder loop and module names) with a sparse MoE block as
``mlp``: a router (``gate``), stacked experts (``experts``: see :mod:`tessera.models.hf_experts`) and,
in Qwen2-MoE, a shared expert with a sigmoid gate. So pipeline stages and Ulysses are the Hugging Face
Llama policy's; tensor parallelism splits attention (and a shared expert or a dense layer's MLP as
Llama's MLP) and leaves the router and the experts whole on every tp rank, which see the same tokens;
expert parallelism (Plan.ep) splits the experts instead.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from tessera.models.policies.hf_llama import HF_LLAMA
from tessera.parallel.policy import Policy

FAMILIES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _is_hf_moe(model: nn.Module) -> bool:
    return type(model).__name__ in FAMILIES


def _tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    layers = "model.layers.*"
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        f"{layers}.self_attn.q_proj": ColwiseParallel(),
        f"{layers}.self_attn.k_proj": ColwiseParallel(),
        f"{layers}.self_attn.v_proj": ColwiseParallel(),
        f"{layers}.self_attn.o_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for index, layer in enumerate(model.model.layers):  # dense MLPs (a dense layer's, a shared expert) as Llama's
        for name, mlp in (("mlp", layer.mlp), ("mlp.shared_expert", getattr(layer.mlp, "shared_expert", None))):
            if mlp is not None and hasattr(mlp, "gate_proj"):
                path = f"model.layers.{index}.{name}"
                plan |= {f"{path}.gate_proj": ColwiseParallel(), f"{path}.up_proj": ColwiseParallel()}
                plan[f"{path}.down_proj"] = RowwiseParallel()
    return plan


def _sizes(model: nn.Module) -> dict[str, int]:
    config = model.config
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
    }
    for name in ("shared_expert_intermediate_size", "intermediate_size"):  # split under tp where dense
        if getattr(config, name, None) and (name != "intermediate_size" or _has_dense_mlp(model)):
            sizes[name] = getattr(config, name)
    return sizes


def _has_dense_mlp(model: nn.Module) -> bool:
    return any(hasattr(layer.mlp, "gate_proj") for layer in model.model.layers)


HF_MOE: Policy = dataclasses.replace(
    HF_LLAMA,
    name="Hugging Face MoE (Mixtral, Qwen2-MoE, Qwen3-MoE)",
    matches=_is_hf_moe,
    sizes=_sizes,
    tp_plan=_tp_plan,
    sequence_parallel_plan=None,  # the residual stream split over the sequence: not taken by the MoE block yet
)
