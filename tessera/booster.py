"""The Booster: apply a Plan to a model, optimizer and data, keeping the user's loop unchanged.

It resolves the Plan, looks the model's policy up once, picks the engine that runs this kind of
layout (:mod:`tessera.runtime`) and delegates to it.

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
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from tessera import distributed, traffic
from tessera.data.sharding import ShardedLoader, ShareBatchSampler, split_batch
from tessera.errors import PlanError
from tessera.models.moe import after_step, moe_layers
from tessera.models.policies import find_policy, missing_policy
from tessera.optim.wrapper import BoostedOptimizer
from tessera.parallel import data_parallel, fault_tolerant
from tessera.parallel.experts import uneven_expert_groups
from tessera.parallel.grad_norm import clip_grads_
from tessera.parallel.outer import Across, OuterSync
from tessera.parallel.tensor import align_grad_placements
from tessera.plan import Plan
from tessera.precision import DynamicLossScaler
from tessera.runtime import Context, Engine, FlatEngine, Hooks, Meshes, PipelineEngine, ReplicasEngine
from tessera.runtime.engine import inputs_and_target
from tessera.runtime.optimizer import boost_optimizer
from tessera.testbed.seat import current_seat


def _node_name() -> str:
    """The node this process runs on: its testbed node, else the host."""
    seat = current_seat()
    return seat.node if seat is not None else socket.gethostname()


class Booster:
    """Applies one :class:`~tessera.Plan` to a model, its optimizer and its data."""

    def __init__(self, plan: Plan | None = None, hooks: Hooks | None = None) -> None:
        """``hooks``: an observer of the runtime's hook points (:class:`tessera.runtime.Hooks`),
        e.g. :class:`tessera.cluster.emulate.EmulationHooks` to play a cluster's devices."""
        plan = plan if plan is not None else Plan()
        if not isinstance(plan, Plan):
            raise PlanError(
                f"Booster(plan=...) needs a tessera.Plan (e.g. tessera.ZeRO(stage=2)), got {type(plan).__name__}."
            )
        # Validate everything that can be checked before touching a process group.
        self.device = distributed.pick_device(plan.device, plan.placement)
        distributed.init()
        world, rank = dist.get_world_size(), dist.get_rank()
        self.groups = plan.groups
        self.fault_tolerant = self.groups is not None and self.groups.fault_tolerant
        if self.fault_tolerant:  # this job is one group: the rest of the Plan lays it out
            assert self.groups is not None
            self.group_index = fault_tolerant.group_from_env(self.groups.count)
            try:  # laid out its own way (groups.layouts)
                self.plan = plan.group_plan(self.group_index).resolve(world)
            except PlanError as exc:
                raise type(exc)(f"group {self.group_index} of Plan.groups, on its {world} ranks: {exc}") from None
            fault_tolerant.check_group_job(self.groups, self.group_index, self.plan, world)
        else:
            self.plan = plan.resolve(world)
            self.group_index = self.plan.coords(rank).group  # under Plan.groups: which group this rank trains in
        coords = self.plan.coords(rank)
        self.dp_rank, self.sp_rank = coords.dp, coords.sp  # which samples, which slice of each sequence
        shares = self.plan.shares()
        self._share_weight = shares[self.dp_rank] * len(shares) / sum(shares)  # inside this rank's group
        self.hooks = hooks if hooks is not None else Hooks()
        self.hooks.bind(self.plan, dist.get_rank())
        traffic.install()  # count every collective's bytes per link class from here on
        traffic.bind_job(self.hooks.node() or _node_name(), self.group_index or 0)
        self._ctx = Context(
            plan=self.plan,
            rank=dist.get_rank(),
            device=self.device,
            meshes=Meshes(self.plan, self.device),
            hooks=self.hooks,
            policy=None,
            missing_policy=lambda feature: PlanError(feature),
            scaler=DynamicLossScaler() if self.plan.precision == "fp16" else None,
            # Each rank's loss is a mean over its own samples; weight it by its share so the
            # averaged gradient is the gradient of the mean over the whole global batch (its group's
            # batch when the groups train apart).
            loss_weight=self._share_weight * self._across_weight(),
        )
        self.engine: Engine = (
            ReplicasEngine(self._ctx)
            if self.plan.replicas is not None
            else PipelineEngine(self._ctx)
            if self.plan.pp > 1
            else FlatEngine(self._ctx)
        )

    @property
    def scaler(self) -> DynamicLossScaler | None:
        return self._ctx.scaler

    @property
    def loss_weight(self) -> float:
        return self._ctx.loss_weight

    # ------------------------------------------------------------------ boost
    def boost(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, BoostedOptimizer | None]:
        """Lay ``model`` and ``optimizer`` out as the Plan says; use the returned pair from now on."""
        if not isinstance(model, nn.Module):
            raise PlanError(f"boost() needs a torch.nn.Module, got {type(model).__name__}.")
        if optimizer is None and self.groups is not None:
            raise PlanError(
                "Plan.groups synchronises the groups after their optimizer's steps: pass the optimizer to boost()."
            )
        if self._ctx.model is not None:
            raise PlanError("this Booster already boosted a model: make one Booster per model.")
        names: dict[int, list[str]] = {}  # every name of each parameter (tied weights have several)
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        if optimizer is not None:
            foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
            if foreign:
                raise PlanError(
                    f"the optimizer holds {len(foreign)} parameter(s) that are not in the model: "
                    "build the optimizer from model.parameters()."
                )
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
        if experts:  # the step's routing counts, and the loss-free bias
            self._ctx.optimizer.after_step.append(lambda: after_step(model))
        if self.groups is not None and self.groups.sync != "every_step":  # after the inner steps
            # groups that differ in size or layout meet in canonical slots, as many as the smallest has ranks
            slots = min(self.groups.sizes or (dist.get_world_size(),)) if self.groups.differ else None
            inside = self._ctx.meshes.inside
            across: dist.ProcessGroup | Across = (
                fault_tolerant.TorchftAcross.from_env(self.group_index, self.device.type, slots, inside)
                if self.fault_tolerant
                else self._ctx.meshes.group("group")
            )
            module = data_parallel.unwrap(wrapped)
            blocks = {id(b) for b in data_parallel.repeated_blocks(module)}
            outer = OuterSync(
                dict(module.named_parameters()),
                across,
                self.groups,
                self._group_weights(),
                self.group_index,
                members=inside,
                blocks=[name for name, m in module.named_modules() if id(m) in blocks],
                holders=self._ctx.meshes.grad.get_group(),
                slots=slots,
                order=[every[0] for every in names.values()],  # the whole model's, as every group cuts slots
            )
            if isinstance(across, fault_tolerant.TorchftAcross):
                across.attach(outer)
            self._ctx.optimizer.outer = outer
        return wrapped, self._ctx.optimizer

    def _across_weight(self) -> float:
        """What this group's share of the batch weighs in gradients averaged across groups every step."""
        groups = self.groups
        if groups is None or groups.sync != "every_step":
            return 1.0
        return self._group_weights()[self.group_index] * groups.count

    def _group_weights(self) -> list[float]:
        """Each group's share of the global batch (they sum to 1)."""
        assert self.groups is not None
        shares = self.groups.group_shares()
        return [s / sum(shares) for s in shares]

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks over which this rank's pipeline is spread (None when it holds the whole model)."""
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
        if not self.engine.plain_backward:
            raise PlanError(
                "Plan.replicas trains through booster.execute_pipeline(batch, model, loss_fn, optimizer), which "
                "also averages each layer's gradient over its holders; booster.backward alone would not."
            )
        self._ctx.backward(loss)

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

        Takes the next batch of ``data_iter`` (or ``data_iter`` itself when it is a batch): a pair
        ``(inputs, target)`` or a dict with ``x``/``input_ids`` and ``y``/``labels``. Returns the
        mean loss of this rank's batch, the same value on every stage of a pipeline (use
        :meth:`reduce_loss` for the mean over the global batch). Gradients are ready for
        ``clip_grad_norm`` and ``optimizer.step()``. Without pipeline parallelism the
        micro-batches are plain gradient accumulation, so one loop serves every Plan.

        Example:
            >>> loss = booster.execute_pipeline(iter(loader), model, loss_fn, optimizer)
            >>> optimizer.step(); optimizer.zero_grad()
        """
        batch = next(data_iter) if isinstance(data_iter, Iterator) else data_iter
        inputs, target = inputs_and_target(batch)
        loss = self.engine.forward_backward(inputs, target, model, loss_fn)
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
        inputs, target = inputs_and_target(batch)
        was_training = model.training
        model.eval()
        try:
            return self.engine.evaluate(inputs, target, model, loss_fn)
        finally:
            model.train(was_training)
            # ZeRO-2 keeps gathered parameters after a forward for the backward, which reshards them; with no
            # backward they would stay whole, and the next checkpoint would not find the optimizer's shards
            data_parallel.reshard(model)

    def clip_grad_norm(
        self, model: nn.Module, optimizer: BoostedOptimizer | None = None, max_norm: float = 1.0, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the global gradient norm over every shard; return that norm (before clipping)."""
        params = list(model.parameters())
        align_grad_placements(params)
        if self.scaler is not None and self.scaler.unscale_(params):
            return torch.tensor(float("inf"))  # overflow: the step will be skipped anyway
        across, uncounted = self.engine.norm_groups()
        split = uneven_expert_groups(model)
        return clip_grads_(params, max_norm, norm_type, across=across, uncounted=set(uncounted), split=split)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (gradient accumulation); sync on the next backward outside it."""
        return data_parallel.no_sync(model)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss over the whole global batch (every rank gets the same value); under fault-tolerant
        groups, over this group's part of it (the groups meet only at outer syncs)."""
        value = self.engine.reduce_loss(distributed.local(loss.detach()).float() * self._share_weight)
        if self.plan.groups is not None:  # each group's mean, weighted by its share of the batch
            value *= self._group_weights()[self.group_index]
            dist.all_reduce(value, group=self._ctx.meshes.group("group"))
        return value

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
        if self.plan.groups is not None:
            raise PlanError(
                "token_mean_scale with Plan.groups is not supported yet: each group's optimizer would need the "
                "count of its own data only; average per sample instead, or train without groups."
            )
        count = (distributed.local(target) != ignore_index).sum().to(torch.float64).reshape(1)
        total = float(self.engine.sum_over_data(count))
        if total == 0:
            raise PlanError("token_mean_scale: the global batch has no counted token (every target is ignored).")
        return self.plan.pipeline.microbatches * self.engine.data_ranks() / (self._ctx.loss_weight * total)

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
        split, data_rank = self._batch_split(global_batch_size)
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

    def _batch_split(self, global_batch_size: int) -> tuple[list[int], int]:
        """Samples of every global batch per data rank (the shares, group after group) and which entry this
        rank reads. A fault-tolerant group's job knows its own ranks only: the other groups count as one
        entry each, their share of the batch, which puts this group's samples where they would be."""
        if not self.fault_tolerant:
            return self.plan.batch_split(global_batch_size), self.plan.data_rank(dist.get_rank())
        assert self.groups is not None
        per_group = split_batch(global_batch_size, self.groups.group_shares())
        g = self.group_index
        mine = split_batch(per_group[g], self.plan.shares())
        return [*per_group[:g], *mine, *per_group[g + 1 :]], g + self.plan.data_rank(dist.get_rank())

    # ------------------------------------------------------------------ state
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded parameters and buffers on the CPU, keyed like the original model
        (every stage's, under pipeline parallelism; every rank gets them all)."""
        out = {}
        for key, value in data_parallel.unwrap(model).state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[key] = value.detach().to("cpu", copy=True)
        group = self.stage_group
        if group is not None:
            parts: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(parts, out, group=group)
            out = {k: v for part in parts for k, v in part.items()}
        return out
