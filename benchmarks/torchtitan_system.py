"""torchtitan's Llama laid out by torchtitan, for ``benchmarks/gpu_check.py``'s torchtitan columns.

The model is torchtitan's own (``torchtitan.models.llama3``, FlexAttention with a causal mask, fused q/k/v)
configured to the check's shape, and ``parallelize_llama`` applies torchtitan's own FSDP2, per-block
compile and float8 (its ``Float8LinearConverter``). The training step is the check's plain one
(forward, cross-entropy, backward, AdamW) and not torchtitan's ``Trainer``. The Trainer needs a tokenizer
and a dataset from the torchtitan repository's test assets, which the wheel does not ship, and its
loop adds logging and checkpoint hooks that none of the other columns have.

torchtitan 0.3.0 imports triton at import time (its expert-parallel kernels), so it runs where a CUDA
build of torch brings triton. ``make gpu-wheels`` downloads it and its small dependencies into
``.gpu_wheels/`` for a machine without network access.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

VERSION = "0.3.0"


def available() -> str | None:
    """None when torchtitan imports here, else why not (one line)."""
    try:
        import torchtitan.models.llama3  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency failing at import
        return f"torchtitan {VERSION} does not import here: {type(exc).__name__}: {exc}"[:300]
    return None


def config(shape: dict, seq: int, fp8: bool, compiled: bool, emulate: bool, flex: bool):
    """torchtitan's Llama3 configuration at the check's ``shape`` (tessera LlamaConfig fields). ``flex``:
    its default FlexAttention (causal block mask); otherwise its SDPA attention (causal), for a CPU, where
    FlexAttention has no backward."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (  # the helpers its own configurations (1B, 8B, ...) are built with
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    dim, vocab, heads = shape["dim"], shape["vocab_size"], shape["n_heads"]
    model = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=shape["n_layers"],
            dim=dim,
            n_heads=heads,
            n_kv_heads=shape["n_kv_heads"],
            hidden_dim=shape["ffn_dim"],
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq, theta=10000.0),
            attn_backend="flex",
        ),
    )
    if not flex:
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if fp8:
        from torchtitan.components.quantization import Float8LinearConverter

        # (its rowwise recipe, the default. torchtitan refuses emulation with compile; the tiny CPU mode compiles
        # with dynamo's "eager" backend, which emulation survives, so it is not told)
        converter = Float8LinearConverter.Config(model_compile_enabled=compiled and not emulate, emulate=emulate)
        model = converter.build().convert(model)
    return model


def build(
    shape: dict, seq: int, device: torch.device, compiled: bool, fp8: bool, dtype: str
) -> Callable[[torch.Tensor], None]:
    """One training step of torchtitan's Llama on this rank's device (one rank: FSDP2 over one device, as
    the other columns), with bf16 parameters in the forward and fp32 reductions (``dtype`` "bf16"), or fp32."""
    import torch.distributed as dist
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama

    if device.type == "cpu":  # torchtitan takes "cuda" when no accelerator is present: the tiny CPU mode says cpu
        import torchtitan.distributed.parallel_dims as parallel_dims

        parallel_dims.device_type = "cpu"
    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")  # fmt: skip
    param = "bfloat16" if dtype == "bf16" or fp8 else "float32"
    training = TrainingConfig(local_batch_size=1, seq_len=seq, mixed_precision_param=param,
                              mixed_precision_reduce="float32")  # fmt: skip
    backend = "inductor" if device.type == "cuda" else "eager"  # tiny CPU mode: tracing only, as the others
    with torch.device("meta"):
        cpu = device.type == "cpu"
        flex = not cpu
        model = config(shape, seq, fp8, compiled, emulate=cpu, flex=flex).build()
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        compile_config=CompileConfig(enable=compiled, components=["model"], backend=backend),
        ac_config=None,
        dump_folder="/tmp",
    )
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(tokens: torch.Tensor) -> None:
        inputs = tokens[:, :-1]
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
        masks = model.get_attention_masks(positions) if flex else None  # SDPA: causal, no mask
        logits = model(inputs, positions, masks)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()

    return step
