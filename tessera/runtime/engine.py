"""What every engine shares: the protocol the Booster drives, and the per-step context.

An engine owns one way of running a Plan: the whole model per rank (:mod:`.flat`), a grid of
pipeline stages (:mod:`.pipelined`), or replicas of different depth (:mod:`.replicated`). The
Booster picks the engine (:func:`tessera.runtime.engine_for`) and delegates; a new way of running a
step is a new engine, not a new branch. (What happens between ``Plan.groups`` is not a way of running a
step: it attaches itself to the optimizer, :mod:`tessera.across.membership`.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from tessera.distributed import local
from tessera.errors import PlanError
from tessera.parallel import data_parallel
from tessera.parallel.experts import uneven_expert_groups
from tessera.parallel.grad_norm import clip_grads_
from tessera.parallel.policy import Policy
from tessera.parallel.tensor import align_grad_placements
from tessera.plan import Plan
from tessera.precision import DynamicLossScaler
from tessera.runtime.hooks import Hooks
from tessera.runtime.meshes import Meshes
from tessera.runtime.microbatches import LossFn, forward_only


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

    @classmethod
    def for_rank(cls, plan: Plan, device: torch.device, hooks: Hooks, loss_weight: float) -> Context:
        """This rank's context for a resolved ``plan`` (meshes built on first use, no model yet)."""
        return cls(
            plan=plan,
            rank=dist.get_rank(),
            device=device,
            meshes=Meshes(plan, device),
            hooks=hooks,
            policy=None,
            missing_policy=lambda feature: PlanError(feature),
            scaler=DynamicLossScaler() if plan.precision == "fp16" else None,
            loss_weight=loss_weight,
        )

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
    #: each counted gradient's local part is a piece no other counted part repeats, so the norm adds the parts
    #: over :meth:`norm_groups` alone, not first over their shard groups (replicas that differ in tp)
    norm_pieces = False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def wrap(self, model: nn.Module, names: list[list[str]]) -> nn.Module:
        """This rank's part of ``model``, laid out; ``names``: every name of each parameter, in model order."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """``Booster.backward``: the loss's backward, weighted and scaled (refused where it is not enough)."""
        if not self.plain_backward:
            raise PlanError(
                "Plan.replicas trains through booster.execute_pipeline(batch, model, loss_fn, optimizer), which "
                "also averages each layer's gradient over its holders; booster.backward alone would not."
            )
        self.ctx.backward(loss)

    def forward_backward(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of this rank's batch over the Plan's micro-batches; the mean loss."""
        raise NotImplementedError

    def evaluate(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        """Forward only, over the Plan's micro-batches: the mean loss of this rank's batch."""
        return forward_only(self.ctx, inputs, target, model, loss_fn)

    def evaluate_batch(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        """:meth:`evaluate` with the model in eval mode, then as it was, and resharded: ZeRO-2 keeps gathered
        parameters after a forward for the backward, which reshards them; with no backward they would stay
        whole, and the next checkpoint would not find the optimizer's shards."""
        was_training = model.training
        model.eval()
        try:
            return self.evaluate(inputs, target, model, loss_fn)
        finally:
            model.train(was_training)
            data_parallel.reshard(model)

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

    def token_mean_scale(self, target: torch.Tensor, ignore_index: int) -> float:
        """What makes a micro-batch's summed loss this rank's part of the mean over every counted token of the
        global batch (:meth:`tessera.Booster.token_mean_scale`): one all-reduce of a count."""
        count = (local(target) != ignore_index).sum().to(torch.float64).reshape(1)
        total = float(self.sum_over_data(count))
        if total == 0:
            raise PlanError("token_mean_scale: the global batch has no counted token (every target is ignored).")
        return self.ctx.plan.pipeline.microbatches * self.data_ranks() / (self.ctx.loss_weight * total)

    def clip_grad_norm(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip ``model``'s gradients by their global norm over every shard; that norm (before clipping), or
        inf when fp16 gradients overflowed (the step will be skipped)."""
        params = list(model.parameters())
        align_grad_placements(params)
        if self.ctx.scaler is not None and self.ctx.scaler.unscale_(params):
            return torch.tensor(float("inf"))
        across, uncounted = self.norm_groups()
        split = uneven_expert_groups(model)
        return clip_grads_(
            params, max_norm, norm_type, across=across, uncounted=set(uncounted), split=split, pieces=self.norm_pieces
        )

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s full, unsharded parameters and buffers on the CPU, keyed like the original model
        (every stage's, when this rank holds part of it; every rank gets them all)."""
        out = {}
        for key, value in data_parallel.unwrap(model).state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[key] = value.detach().to("cpu", copy=True)
        group = self.state_group()
        if group is not None:
            parts: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(parts, out, group=group)
            out = {k: v for part in parts for k, v in part.items()}
        return out
