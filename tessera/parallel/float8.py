"""FP8 training (``Plan.precision="fp8"``): torchao's float8 linears in the repeated blocks.

Each ``nn.Linear`` inside a block becomes torchao's ``Float8Linear``: its three matmuls (output, input
gradient, weight gradient) take float8 operands scaled per tensor or per row (``Plan.fp8_recipe``) and
give bf16 results. Everything else is bf16 mixed precision as ``precision="bf16"`` runs it (autocast, or
FSDP2's bf16 parameters), with fp32 master weights, gradients and reductions; the head and the
embeddings stay bf16, as torchtitan leaves them, since their error reaches the loss directly.

Under FSDP2 with the tensorwise recipe the block weights are all-gathered in float8 (half bf16's bytes).
Float8 matmuls need an FP8 tensor core (CUDA compute capability 8.9: Ada, Hopper and later); elsewhere
``Plan.fp8_emulate`` runs the same casts and scales with bf16 matmuls (for tests: not faster).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tessera.errors import PlanError

FP8_CAPABILITY = (8, 9)  # the first CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0)
INSTALL = "pip install 'tessera[fp8]' (torchao)"


def fp8_problem(device: torch.device, emulate: bool) -> str | None:
    """Why FP8 training cannot run on ``device`` (None when it can): torchao missing, or a device with no
    float8 matmul and emulation not asked for."""
    try:
        _torchao_float8()
    except ImportError as exc:
        return f'Plan.precision="fp8" trains through torchao, which is not installed ({exc}): {INSTALL}.'
    if emulate:
        return None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= FP8_CAPABILITY:
            return None
        name = torch.cuda.get_device_name(device)
        found = f"{name} (compute capability {capability[0]}.{capability[1]})"
    else:
        found = f"the {device.type.upper()}"
    return (
        f'Plan.precision="fp8" needs float8 matmuls (CUDA compute capability 8.9 or later: L4, RTX 4090, H100, '
        f'H200), which {found} does not have: use precision "bf16", or set plan.fp8_emulate: true to emulate '
        "FP8 with bf16 matmuls (same numerics, slower than bf16: for tests)."
    )


def apply_float8(blocks: list[nn.Module], recipe: str, emulate: bool, fsdp: bool) -> int:
    """Convert every ``nn.Linear`` inside ``blocks`` to torchao's float8 linear (``recipe``: tensorwise or
    rowwise), in place; return how many. ``fsdp``: the blocks will be sharded by FSDP2, which then gathers
    tensorwise weights in float8."""
    float8 = _torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = type(config)(**{**config.__dict__, "emulate": emulate,
                             "enable_fsdp_float8_all_gather": fsdp and recipe == "tensorwise"})  # fmt: skip
    converted = 0

    def eligible(module: nn.Module, fqn: str) -> bool:  # float8 matmuls need both sizes divisible by 16
        nonlocal converted
        ok = isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0
        converted += ok
        return ok

    for block in blocks:
        float8.convert_to_float8_training(block, config=config, module_filter_fn=eligible)
    if not converted:
        raise PlanError(
            'Plan.precision="fp8" found no linear layer in the transformer blocks with both sizes divisible by '
            '16 (float8 matmuls need it): use precision "bf16".'
        )
    return converted


def _torchao_float8() -> Any:
    """torchao's float8 training module. Its import warns, through logging, of CUDA kernels a CPU-only or
    older-GPU machine cannot load (not the ones FP8 training uses) and of a torch deprecation (its enum
    registered with pytree): both kept quiet, as they ask nothing of the user."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return float8
