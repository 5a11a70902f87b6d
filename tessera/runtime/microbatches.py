"""Micro-batches without a pipeline: a batch cut along its first dimension, run as gradient accumulation
(or forward only), and the batch forms the runtime takes (a pair, a dict, packed records' keyword inputs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera import distributed
from tessera.errors import PlanError
from tessera.packing import records_mask
from tessera.parallel import data_parallel
from tessera.parallel.pipeline import check_microbatches

if TYPE_CHECKING:  # the engine's per-rank context; engine.py imports this module
    from tessera.runtime.engine import Context

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


def _chunks(inputs: Any, n: int) -> list[Any]:
    """``inputs`` (a tensor, or a dict of keyword inputs) cut into ``n`` micro-batches along dim 0."""
    if isinstance(inputs, dict):
        return [dict(zip(inputs, parts)) for parts in zip(*(value.chunk(n) for value in inputs.values()))]
    return list(inputs.chunk(n))


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(**keyword_inputs(inputs)) if isinstance(inputs, dict) else model(inputs)


def _rows(inputs: Any) -> int:
    return next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else inputs.shape[0]


def accumulate(ctx: Context, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
    """Micro-batches as gradient accumulation (no pipeline): synchronise on the last one only."""
    n = ctx.plan.pipeline.microbatches
    check_microbatches(_rows(inputs), n)
    total = torch.zeros((), device=target.device)
    for i, (x, y) in enumerate(zip(_chunks(inputs, n), target.chunk(n))):
        with data_parallel.no_sync(model) if i < n - 1 else contextlib.nullcontext():
            with ctx.loss_parallel():
                loss = loss_fn(_call(model, x), y)
            ctx.backward(loss, fraction=1 / n)
        total += distributed.local(loss.detach()).float()
    return total / n


@torch.no_grad()
def forward_only(ctx: Context, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
    """Micro-batches forward (no pipeline): the mean loss, nothing kept for a backward."""
    n = ctx.plan.pipeline.microbatches
    check_microbatches(_rows(inputs), n)
    total = torch.zeros((), device=target.device)
    for x, y in zip(_chunks(inputs, n), target.chunk(n)):
        with ctx.loss_parallel():
            total += distributed.local(loss_fn(_call(model, x), y)).float()
    return total / n


def inputs_and_target(batch: Any) -> tuple[Any, torch.Tensor]:
    """Split a batch into (inputs, target): a pair, or a dict with x/input_ids and y/labels. A dict that also
    has ``documents`` (packed records) gives them with the tokens and positions (:func:`keyword_inputs` makes
    a model's keyword inputs of them; a pipeline passes them from stage to stage)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        x = next((batch[k] for k in ("x", "input_ids") if k in batch), None)
        y = next((batch[k] for k in ("y", "labels") if k in batch), None)
        if x is not None and y is not None:
            if "documents" in batch:
                return {"input_ids": x, "position_ids": batch["position_ids"], "documents": batch["documents"]}, y
            return x, y
    keys = f" (keys: {', '.join(map(str, batch))})" if isinstance(batch, dict) else ""
    raise PlanError(
        f"execute_pipeline needs batches of (inputs, target) or dicts with 'x'/'input_ids' and 'y'/'labels', "
        f"got {type(batch).__name__}{keys}."
    )


def keyword_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face model's keyword inputs: packed records' ``documents`` become their attention mask."""
    if "documents" not in inputs:
        return inputs
    rest = {k: v for k, v in inputs.items() if k != "documents"}
    return {**rest, "attention_mask": records_mask(inputs["documents"])}
