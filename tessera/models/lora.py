"""LoRA adapters through ``peft`` (the library, not a rewrite), for any model Tessera lays out with data
parallelism or ZeRO.

``with_lora(model, r=8, alpha=16, target_modules=("q_proj", "v_proj"))`` wraps the model with peft's
``get_peft_model``: the base weights are frozen (``requires_grad=False``), so they get no gradients, no
reductions (DDP and FSDP reduce only what requires a gradient) and no optimizer state (give the optimizer
the trainable parameters). A pretrained model whose parameters are still on meta
(:func:`tessera.models.pretrained.empty_pretrained`) keeps them there: the adapters alone get memory and
peft's initialisation now (``reset_lora_parameters``: the same on every rank for the same seed, though
not the draws peft makes on a real base, whose construction draws first), and the base weights are
read once the model is laid out.

Example::

    torch.manual_seed(0)
    model = with_lora(empty_pretrained("llama_dir"), r=8, alpha=16)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = booster.boost(model, torch.optim.AdamW(trainable, lr=1e-4))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

LORA_MARK = ".lora_"  # in the names of the adapters' parameters


def _require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ImportError("LoRA needs the optional dependency: pip install 'tessera[lora]' (peft)") from None


def with_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    target_modules: Sequence[str] = ("q_proj", "v_proj"),
) -> nn.Module:
    """``model`` with peft LoRA adapters on ``target_modules`` (their names' last part), base frozen."""
    _require_peft()
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    wrapped = get_peft_model(model, config)
    for module in wrapped.modules():  # on a meta base, peft puts the adapters on meta too: give them values
        if isinstance(module, LoraLayer) and any(p.is_meta for p in _adapter_parameters(module)):
            for adapters in (module.lora_A, module.lora_B):
                adapters.to_empty(device=torch.device("cpu"))
            for name in module.lora_A:
                module.reset_lora_parameters(name, config.init_lora_weights)
    return wrapped


def _adapter_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for adapters in (module.lora_A, module.lora_B) for p in adapters.parameters()]


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to a LoRA adapter."""
    return LORA_MARK in name


def base_name(name: str) -> str:
    """The name a parameter has in the model without peft (its weights' files use it): peft adds
    ``base_model.model.`` in front and ``base_layer.`` inside an adapted layer."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def merged(model: nn.Module) -> nn.Module:
    """The base model with every adapter folded into its weights (peft's ``merge_and_unload``)."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
