"""A model family's policy seen through peft: a LoRA-wrapped model (``PeftModel``) is laid out with its base
model's policy.

peft keeps the base model under ``base_model.model.`` and replaces each adapted ``nn.Linear`` by a
``lora.Linear`` holding it as ``base_layer`` next to the adapters ``lora_A`` (in → r) and ``lora_B``
(r → out). Under tensor parallelism an adapted projection is split as its base layer is and the rank-r
side of its adapters is held whole on every rank:

- column-parallel (output features split): ``lora_A`` replicated, ``lora_B`` column-parallel; its input's
  gradient, partial on each rank, is all-reduced by ``lora_B`` (as for any column-parallel layer), so
  ``lora_A``'s gradient is whole;
- row-parallel (input features split): ``lora_A`` row-parallel (its rank-r output all-reduced), ``lora_B``
  replicated, its output laid out as the base layer's.

Pipeline stages are cut at the base model's places under the prefix, so parameter names stay the
peft model's in every layout (checkpoints load across layouts).
"""

from __future__ import annotations

from dataclasses import replace
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from tessera.errors import PlanError
from tessera.parallel.policy import PipelineLayout, Policy
from tessera.parallel.tensor import Replicated

PREFIX = "base_model.model."  # where peft keeps the base model


def peft_base(model: nn.Module) -> nn.Module | None:
    """The base model inside a peft model, or None when ``model`` is not one."""
    if type(model).__name__.startswith("Peft") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return None


def _base(model: nn.Module) -> nn.Module:
    """The base model of a peft model (the policy's hooks are called with the whole peft model)."""
    base = peft_base(model)
    return model if base is None else base


def through_peft(policy: Policy) -> Policy:
    """``policy`` (the base model's family's) for the same family wrapped by peft."""
    return replace(
        policy,
        name=f"{policy.name} with LoRA adapters",
        matches=lambda m: peft_base(m) is not None and policy.matches(peft_base(m)),
        sizes=lambda m: policy.sizes(_base(m)),
        tp_plan=lambda m: _adapted(policy.tp_plan(_base(m)), _base(m), policy),
        sequence_parallel_plan=None
        if policy.sequence_parallel_plan is None
        else lambda m: _adapted(policy.sequence_parallel_plan(_base(m)), _base(m), policy),  # type: ignore[misc]
        tied_embeddings=lambda m: policy.tied_embeddings(_base(m)),
        head=PREFIX + policy.head,
        ulysses=None if policy.ulysses is None else _ulysses(policy),
        pipeline=None if policy.pipeline is None else _prefixed(policy.pipeline),
        after_tp=None if policy.after_tp is None else _after_tp(policy),
    )


def _adapted(plan: dict[str, ParallelStyle], base: nn.Module, policy: Policy) -> dict[str, ParallelStyle]:
    """The base model's tp plan under the peft prefix, each adapted projection split as said above."""
    from peft.tuners.lora import LoraLayer

    modules = dict(base.named_modules())
    adapted = {name for name, m in modules.items() if isinstance(m, LoraLayer)}
    out: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        matched = [name for name in modules if fnmatch(name, pattern)]
        if adapted.isdisjoint(matched):
            out[PREFIX + pattern] = style
            continue
        for name in matched:  # adapted ones split, the others keep the style
            out.update(
                _split_adapted(name, modules[name], style, policy) if name in adapted else {PREFIX + name: style}
            )
    return out


def _split_adapted(name: str, layer: Any, style: ParallelStyle, policy: Policy) -> dict[str, ParallelStyle]:
    """The styles of one peft ``lora.Linear`` (``name`` in the base model) whose base layer gets ``style``."""
    from peft.tuners.lora import Linear as LoraLinear

    where = f"LoRA on {name} with tensor parallelism (Plan.tp > 1)"
    split = type(style) in (ColwiseParallel, RowwiseParallel) and isinstance(layer, LoraLinear)
    if name == policy.head or not split:
        raise PlanError(f"{where} is not supported: adapt the attention and MLP projections only, or use tp=1.")
    if getattr(layer, "lora_variant", None):
        raise PlanError(f"{where}: peft's variants (DoRA and others) are not supported; use plain LoRA or tp=1.")
    if any(not isinstance(d, nn.Identity) for d in layer.lora_dropout.values()):
        raise PlanError(
            f"{where}: LoRA dropout would drop different features on each tp rank; set model.lora.dropout: 0 "
            "or use tp=1."
        )
    (input_layout,), (output_layout,) = style.input_layouts, style.output_layouts
    at = PREFIX + name
    if isinstance(style, ColwiseParallel):
        a: ParallelStyle = Replicated(input_layout=input_layout)
        b: ParallelStyle = ColwiseParallel(output_layouts=output_layout, use_local_output=style.use_local_output)
    else:
        a = RowwiseParallel(input_layouts=input_layout, output_layouts=Replicate())
        b = Replicated(output_layout=output_layout, use_local_output=style.use_local_output)
    return {f"{at}.base_layer": style, f"{at}.lora_A.*": a, f"{at}.lora_B.*": b}


class _StageView:
    """A pipeline stage of a peft model as the base family's stage forward expects one: the modules under
    the prefix, the stage's own config, sequence group and buffers."""

    def __init__(self, stage: nn.Module) -> None:
        self._stage, self._inner = stage, stage.get_submodule(PREFIX.rstrip("."))

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._inner, name)
        except AttributeError:
            return getattr(self._stage, name)


def _prefixed(layout: PipelineLayout) -> PipelineLayout:
    def forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layout.forward(_StageView(stage), x)  # type: ignore[arg-type]

    return replace(
        layout,
        layers=PREFIX + layout.layers,
        first=tuple(PREFIX + p for p in layout.first),
        last=tuple(PREFIX + p for p in layout.last),
        every=tuple(PREFIX + p for p in layout.every),
        forward=forward,
        check=None if layout.check is None else lambda m: layout.check(_base(m)),  # type: ignore[misc]
    )


def _ulysses(policy: Policy) -> Any:
    def enable(model: nn.Module, group: object) -> None:
        from tessera.parallel.sequence import offset_positions

        policy.ulysses(_base(model), group)  # type: ignore[misc]
        offset_positions(model, group)  # peft calls the base model's forward directly, past its hooks

    return enable


def _after_tp(policy: Policy) -> Any:
    def after(module: nn.Module, tp: int) -> None:
        inner = module.get_submodule(PREFIX.rstrip("."))
        policy.after_tp(inner if hasattr(inner, "config") else _StageView(module), tp)  # type: ignore[misc]

    return after
