"""What every engine shares: the protocol the Booster drives, and the per-step context.

An engine owns one way of running a Plan: the whole model per rank (:mod:`.flat`), a grid of
pipeline stages (:mod:`.pipelined`), or replicas of different depth (:mod:`.replicated`). The
Booster resolves the Plan, picks the engine and delegates; a new kind of layout (an outer
synchronisation across regions, expert parallelism) is a new engine, not a new branch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from tessera import distributed
from tessera.data.instructions import records_mask
from tessera.errors import PlanError
from tessera.parallel import data_parallel
from tessera.parallel.pipeline import check_microbatches
from tessera.parallel.policy import Policy
from tessera.plan import Plan
from tessera.precision import DynamicLossScaler
from tessera.runtime.hooks import Hooks
from tessera.runtime.meshes import Meshes

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


@dataclass
class Context:
    """One rank's view of the job, shared by the Booster and its engine."""

    plan: Plan  # resolved
    rank: int
    device: torch.device
    meshes: Meshes
    hooks: Hooks
    policy: Policy | None  # the model family's, looked up once (None: no family matched)
    missing_policy: Callable[[str], Exception]  # the error for a feature that needs a policy
    scaler: DynamicLossScaler | None
    loss_weight: float  # this rank's share of the global batch, relative to an even split
    model: nn.Module | None = None
    optimizer: Any | None = None
    # layers whose own loss reaches the gradient inside the backward (experts' balance loss): they take the
    # multiplier the runtime gives the batch loss (share weight, micro-batch fraction, fp16 scale)
    weighted_layers: list[Any] = field(default_factory=list)

    def require_policy(self, feature: str) -> Policy:
        if self.policy is None:
            raise self.missing_policy(feature)
        return self.policy

    def loss_parallel(self) -> contextlib.AbstractContextManager[None]:
        return loss_parallel() if self.plan.loss_parallel else contextlib.nullcontext()

    def weigh_layer_losses(self, multiplier: float) -> None:
        """What the next backward multiplies the batch loss by, for layers that add their own loss."""
        for layer in self.weighted_layers:
            layer.loss_scale = multiplier

    def backward(self, loss: torch.Tensor, fraction: float = 1.0) -> None:
        """``(loss × fraction).backward()`` with the rank's share weighting and fp16 loss scaling
        (``fraction``: a micro-batch's part of the batch)."""
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self.weigh_layer_losses(fraction * self.loss_weight * scale)
        if fraction != 1.0:
            loss = loss * fraction
        if self.loss_weight != 1.0:
            loss = loss * self.loss_weight
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        with self.loss_parallel():
            loss.backward()
        self.after_backward()

    def after_backward(self) -> None:
        if self.model is not None:
            self.hooks.after_backward(self.model, self.optimizer)


class Engine:
    """The protocol: lay the model out, run a batch's forward and backward, and name the groups
    that the gradient norm, the loss and the state are gathered over."""

    #: ``Booster.backward`` may be used (False when gradients need the engine's own step)
    plain_backward = True

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def wrap(self, model: nn.Module, names: list[list[str]]) -> nn.Module:
        """This rank's part of ``model``, laid out; ``names``: every name of each parameter, in model order."""
        raise NotImplementedError

    def forward_backward(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of this rank's batch over the Plan's micro-batches; the mean loss."""
        raise NotImplementedError

    def evaluate(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        """Forward only, over the Plan's micro-batches: the mean loss of this rank's batch."""
        return forward_only(self.ctx, inputs, target, model, loss_fn)

    def grad_group(self) -> dist.ProcessGroup | None:
        """The group that averages gradients (ZeRO-1 shards the optimizer state over it)."""
        return self.ctx.meshes.grad.get_group()

    def norm_groups(self) -> tuple[tuple[Any, ...], Collection[int]]:
        """Groups whose partial gradient norms add up, and ids of parameters another rank counts."""
        return (), set()

    def reduce_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of each rank's weighted loss ``value`` over the global batch."""
        grad = self.ctx.meshes.grad
        value /= grad.size()
        dist.all_reduce(value, group=grad.get_group())
        return value

    def state_group(self) -> dist.ProcessGroup | None:
        """The ranks over which this rank's part of the model is spread (None: it holds all of it)."""
        return None

    def data_ranks(self) -> int:
        """How many ranks' weighted losses :meth:`reduce_loss` averages (and gradients are averaged over)."""
        return self.ctx.meshes.grad.size()

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` (a count of this rank's data) summed over the global batch, each sample once."""
        dist.all_reduce(value, group=self.ctx.meshes.grad.get_group())
        return value


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
