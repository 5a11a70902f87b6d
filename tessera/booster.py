"""The Booster: apply a Plan to a model, optimizer and data, keeping the user's loop unchanged.

It joins the job's groups once (:mod:`tessera.across.membership`: the Plan resolved for this job, the
loss and batch weights, the outer sync attached to the optimizer), looks the model's policy up once,
picks the engine that runs this kind of layout (:mod:`tessera.runtime`) and delegates to both.

Example:
    >>> tessera.init()
    >>> booster = tessera.Booster(tessera.ZeRO(stage=3))
    >>> model, optimizer = booster.boost(model, torch.optim.AdamW(model.parameters()))
    >>> loader = booster.dataloader(dataset, global_batch_size=32)
    >>> for batch in loader:
    ...     loss = loss_fn(model(batch["x"]), batch["y"])
    ...     booster.backward(loss, optimizer)
    ...     booster.clip_grad_norm(model, optimizer, max_norm=1.0)
    ...     optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import Dataset

from tessera import distributed, traffic
from tessera.across.membership import Membership, join
from tessera.data.sharding import ShardedLoader, ShareBatchSampler
from tessera.errors import PlanError
from tessera.models.moe import after_step, moe_layers
from tessera.models.policies import find_policy, missing_policy
from tessera.optim.wrapper import BoostedOptimizer
from tessera.parallel import data_parallel
from tessera.plan import Plan
from tessera.precision import DynamicLossScaler
from tessera.runtime import Context, Engine, Hooks, engine_for
from tessera.runtime.microbatches import inputs_and_target
from tessera.runtime.optimizer import boost_optimizer, check_optimizer_params


class Booster:
    """Applies one :class:`~tessera.Plan` to a model, its optimizer and its data."""

    def __init__(self, plan: Plan | None = None, hooks: Hooks | None = None) -> None:
        """``hooks``: an observer of the runtime's hook points (:class:`tessera.runtime.Hooks`),
        e.g. :class:`tessera.testbed.emulate.EmulationHooks` to play a cluster's devices."""
        plan = plan if plan is not None else Plan()
        if not isinstance(plan, Plan):
            raise PlanError(
                f"Booster(plan=...) needs a tessera.Plan (e.g. tessera.ZeRO(stage=2)), got {type(plan).__name__}."
            )
        # Validate everything that can be checked before touching a process group.
        self.device = distributed.pick_device(plan.device, plan.placement)
        distributed.init()
        # The Plan resolved once, for this job (a fault-tolerant group's own layout), and this rank's group.
        self.membership: Membership = join(plan, dist.get_world_size(), dist.get_rank())
        self.plan = self.membership.plan
        coords = self.plan.coords(dist.get_rank())
        self.dp_rank, self.sp_rank = coords.dp, coords.sp  # which samples, which slice of each sequence
        self.hooks = hooks if hooks is not None else Hooks()
        self.hooks.bind(self.plan, dist.get_rank())
        traffic.install()  # count every collective's bytes per link class from here on
        traffic.bind_job(self.hooks.node() or socket.gethostname(), self.membership.index)
        # Each rank's loss is a mean over its own samples; weighted by its share, the averaged gradient is the
        # gradient of the mean over the whole global batch (its group's when the groups train apart).
        self._ctx = Context.for_rank(self.plan, self.device, self.hooks, self.membership.loss_weight)
        self.engine: Engine = engine_for(self._ctx)

    @property
    def group_index(self) -> int:
        """The group of Plan.groups this rank trains in (0 without groups)."""
        return self.membership.index

    @property
    def scaler(self) -> DynamicLossScaler | None:
        return self._ctx.scaler

    @property
    def loss_weight(self) -> float:
        return self._ctx.loss_weight

    def boost(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, BoostedOptimizer | None]:
        """Lay ``model`` and ``optimizer`` out as the Plan says; use the returned pair from now on."""
        if not isinstance(model, nn.Module):
            raise PlanError(f"boost() needs a torch.nn.Module, got {type(model).__name__}.")
        self.membership.check_optimizer(optimizer)
        if self._ctx.model is not None:
            raise PlanError("this Booster already boosted a model: make one Booster per model.")
        names: dict[int, list[str]] = {}  # every name of each parameter (tied weights have several)
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        if optimizer is not None:
            check_optimizer_params(optimizer, names)
        self._ctx.policy = find_policy(model)
        self._ctx.missing_policy = lambda feature: missing_policy(model, feature)
        # Hooks see the blocks before splitting; what they attach survives tp and FSDP wrapping.
        self.hooks.on_model(model, data_parallel.repeated_blocks(model))
        # Tied weights are read before tp or FSDP replace parameters per module and hide the sharing.
        wrapped = self.engine.wrap(model, list(names.values()))
        self._ctx.model = wrapped
        experts = moe_layers(model)
        for layer in experts:  # the balance loss and bias count the routing of the whole batch
            layer.balance_group = self.engine.grad_group()
        self._ctx.weighted_layers = experts
        if optimizer is None:
            return wrapped, None
        self._ctx.optimizer = boost_optimizer(optimizer, wrapped, names, self._ctx, self.engine)
        self.membership.attach(self._ctx.optimizer, wrapped, list(names.values()), self._ctx.meshes, self.device)
        if experts:  # the step's routing counts, and the loss-free bias
            self._ctx.optimizer.register_step_post_hook(lambda *_: after_step(model))
        return wrapped, self._ctx.optimizer

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks this rank's pipeline is spread over (None when it holds the whole model)."""
        return self.engine.state_group()

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh: axes ("dp",), ("dp", "tp") or ("dp", "sp"), with "pp" first under pipelining."""
        return self._ctx.meshes.mesh

    @property
    def grad_mesh(self) -> DeviceMesh:
        """The 1-D mesh over which gradients are averaged: ``dp``, or dp × sp with sequence
        parallelism (sp ranks see different tokens of the same samples)."""
        return self._ctx.meshes.grad

    # --------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, optimizer: BoostedOptimizer | None = None) -> None:
        """``loss.backward()`` with the rank's share weighting and fp16 loss scaling."""
        self.engine.backward(loss)

    def loss_parallel(self) -> contextlib.AbstractContextManager[None]:
        """Compute the loss inside this context: with ``Plan.loss_parallel`` the logits are a DTensor
        split over the vocabulary and cross-entropy runs on the shards (torch's ``loss_parallel``);
        otherwise it does nothing, so the same loop serves every Plan.

        Example:
            >>> with booster.loss_parallel():
            ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            >>> booster.backward(loss, optimizer)
        """
        return self._ctx.loss_parallel()

    def execute_pipeline(
        self,
        data_iter: Iterator[Any] | Any,
        model: nn.Module,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        optimizer: BoostedOptimizer | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one batch over ``Plan.pipeline.microbatches`` micro-batches.

        Takes the next batch of ``data_iter`` (or ``data_iter`` itself): a pair ``(inputs, target)`` or a dict
        with ``x``/``input_ids`` and ``y``/``labels``. Returns the mean loss of this rank's batch, the same on
        every stage of a pipeline (:meth:`reduce_loss` gives the global batch's); gradients are then ready for
        ``clip_grad_norm`` and ``optimizer.step()``. Without pipeline parallelism the micro-batches are plain
        gradient accumulation, so one loop serves every Plan.

        Example:
            >>> loss = booster.execute_pipeline(iter(loader), model, loss_fn, optimizer)
            >>> optimizer.step(); optimizer.zero_grad()
        """
        batch = next(data_iter) if isinstance(data_iter, Iterator) else data_iter
        loss = self.engine.forward_backward(*inputs_and_target(batch), model, loss_fn)
        self._ctx.after_backward()
        return loss

    def evaluate(
        self, data_iter: Iterator[Any] | Any, model: nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Forward only, over the Plan's micro-batches and pipeline stages: the mean loss of this rank's batch
        (:meth:`reduce_loss` gives the global batch's). Every rank of the layout takes part.

        Example:
            >>> val = booster.reduce_loss(booster.evaluate(batch, model, loss_fn))
        """
        batch = next(data_iter) if isinstance(data_iter, Iterator) else data_iter
        return self.engine.evaluate_batch(*inputs_and_target(batch), model, loss_fn)

    def clip_grad_norm(
        self, model: nn.Module, optimizer: BoostedOptimizer | None = None, max_norm: float = 1.0, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the global gradient norm over every shard; return that norm (before clipping; inf when fp16
        gradients overflowed, and the step will be skipped)."""
        return self.engine.clip_grad_norm(model, max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (gradient accumulation); sync on the next backward outside it."""
        return data_parallel.no_sync(model)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss over the whole global batch (every rank gets the same value); under fault-tolerant
        groups, over this group's part of it (the groups meet only at outer syncs)."""
        value = self.engine.reduce_loss(distributed.local(loss.detach()).float() * self.membership.share_weight)
        return self.membership.reduce_loss(value, lambda: self._ctx.meshes.group("group"))

    def token_mean_scale(self, target: torch.Tensor, ignore_index: int = -100) -> float:
        """The factor that makes a micro-batch's loss *summed* over its tokens (``reduction="sum"``) this rank's
        part of the mean over every counted token (``target != ignore_index``) of the global batch: gradients
        and :meth:`reduce_loss` then both give that mean in every layout, however unevenly the counted tokens
        (a fine-tuning set's responses) fall on ranks and micro-batches. One all-reduce of a count.

        Example:
            >>> k = booster.token_mean_scale(batch["y"])
            >>> loss = booster.execute_pipeline(batch, model, lambda o, y: F.cross_entropy(
            ...     o.flatten(0, 1), y.flatten(), reduction="sum") * k, optimizer)
        """
        self.membership.refuse_token_mean()
        return self.engine.token_mean_scale(target, ignore_index)

    # ------------------------------------------------------------------- data
    def dataloader(
        self,
        dataset: Dataset,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
    ) -> ShardedLoader:
        """Batches of this rank's share of every global batch, moved to this rank's device."""
        split, data_rank = self.membership.batch_split(global_batch_size)
        sampler = ShareBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            global_batch_size,
            split,
            data_rank,
            seed=seed,
            shuffle=shuffle,
        )
        seq_slice = (self.sp_rank, self.plan.sp) if self.plan.ulysses_size > 1 else None
        return ShardedLoader(
            dataset, sampler, self.device, collate_fn=collate_fn, num_workers=num_workers, seq_slice=seq_slice
        )

    # ------------------------------------------------------------------ state
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded parameters and buffers on the CPU, keyed like the original model
        (every stage's, under pipeline parallelism; every rank gets them all)."""
        return self.engine.full_state_dict(model)
