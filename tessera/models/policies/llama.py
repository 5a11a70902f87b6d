"""Policy for the reference Llama (tessera.models.Llama)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from tessera.errors import NotSupportedYet
from tessera.parallel.policy import PipelineLayout, Policy


def _is_llama(model: nn.Module) -> bool:
    from tessera.models.llama import Llama

    return isinstance(model, Llama)


def _ulysses(model: nn.Module, group: object) -> None:
    model.sp_group = group  # rotary positions start at this rank's sequence offset
    for layer in model.layers.children():
        layer.attention.sp_group = group


def _stage_forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One pipeline stage of the reference Llama: Llama.forward restricted to what the stage holds."""
    from tessera.models.llama import rotary_positions

    h = stage.tok_embeddings(x) if hasattr(stage, "tok_embeddings") else x
    cos, sin = rotary_positions(stage, h.shape[1])
    for layer in stage.layers.values():
        h = layer(h, cos, sin)
    return stage.output(stage.norm(h)) if hasattr(stage, "output") else h


def _sequence_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Megatron split/gather: the residual stream is a local sequence shard (batch, seq/tp, dim);
    attention and the MLP all-gather it on entry, their row-parallel outputs reduce-scatter back."""
    if model.config.moe is not None and model.config.moe.experts:
        raise NotSupportedYet(
            "split/gather sequence parallelism (Plan.sp_mode='split_gather') of a Llama with experts "
            "(LlamaConfig.moe) is not supported yet: use tp without sp (the experts run on whole sequences)."
        )
    gather = PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": gather,
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Megatron's split of attention and the feed-forward; the MoE layers' routers and experts stay whole
    on every tp rank (the experts split over ep instead), their shared expert splits like a feed-forward."""
    moe = model.config.moe is not None and model.config.moe.experts > 0
    ffn = "layers.*.feed_forward.shared" if moe else "layers.*.feed_forward"
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),  # vocabulary-parallel embedding
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        f"{ffn}.w1": ColwiseParallel(),
        f"{ffn}.w3": ColwiseParallel(),
        f"{ffn}.w2": RowwiseParallel(),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }


def _after_tp(module: nn.Module, tp: int) -> None:
    """Re-tie the output to the embedding: the tp plan gave each its own (equally sharded) copy."""
    if module.config.tie_embeddings and hasattr(module, "output") and hasattr(module, "tok_embeddings"):
        module.output.weight = module.tok_embeddings.weight


LLAMA = Policy(
    name="tessera Llama",
    matches=_is_llama,
    sizes=lambda m: {
        "n_heads": m.config.n_heads,
        "n_kv_heads": m.config.n_kv_heads,
        "ffn_dim": m.config.ffn_dim,
        "vocab_size": m.config.vocab_size,
    },
    tp_plan=_tp_plan,
    head="output",
    tied_embeddings=lambda m: m.config.tie_embeddings,
    ulysses=_ulysses,
    sequence_parallel_plan=_sequence_parallel_plan,
    after_tp=_after_tp,
    pipeline=PipelineLayout(
        layers="layers",
        first=("tok_embeddings",),
        last=("norm", "output"),
        buffers=("rope_cos", "rope_sin"),
        forward=_stage_forward,
    ),
)
