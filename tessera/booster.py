"""The Booster: apply a Plan to a model, optimizer and data, keeping the user's loop unchanged.

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
import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from tessera import distributed
from tessera.cluster.emulate import Emulator
from tessera.cluster.spec import Cluster
from tessera.data.sharding import ShardedLoader, ShareBatchSampler
from tessera.errors import PlanError
from tessera.models.policies import policy_for
from tessera.optim.wrapper import BoostedOptimizer, optimizer_factory, rebuild_optimizer
from tessera.parallel import data as data_parallel
from tessera.parallel.grad_norm import clip_grads_
from tessera.parallel.pipeline import (
    PipelineModel,
    PipelineRunner,
    TiedWeights,
    average_gradients,
    check_microbatches,
    split_model,
    stage_owners,
)
from tessera.parallel.recompute import apply_recompute
from tessera.parallel.replicas import LayerSync, replica_groups, replica_ranks
from tessera.parallel.tensor import align_grad_placements, apply_tensor_parallel
from tessera.parallel.zero1 import ShardedOptimizer
from tessera.plan import Plan
from tessera.precision import DynamicLossScaler


class Booster:
    """Applies one :class:`~tessera.Plan` to a model, its optimizer and its data."""

    def __init__(self, plan: Plan | None = None, emulate: Cluster | str | Path | None = None) -> None:
        """``emulate`` (or the environment variable ``TESSERA_EMULATE``): a cluster file whose devices
        these ranks play (:mod:`tessera.cluster.emulate`)."""
        plan = plan if plan is not None else Plan()
        if not isinstance(plan, Plan):
            raise PlanError(
                f"Booster(plan=...) needs a tessera.Plan (e.g. tessera.ZeRO(stage=2)), got {type(plan).__name__}."
            )
        # Validate everything that can be checked before touching a process group.
        self.device = distributed.pick_device(plan.device, plan.placement)
        distributed.init()
        self.plan = plan.resolve(dist.get_world_size())
        # Ranks are laid out (pp, dp, tp) or (pp, dp, sp) row-major, as init_device_mesh does: the
        # ranks of one tp or sp group are neighbours and share their samples, and every stage of
        # one pipeline reads the same samples.
        self.replica = replica_ranks(self.plan, dist.get_rank()) if self.plan.replicas is not None else None
        # Replicas of different depth take consecutive ranks: no grid, the replica is the dp rank.
        grid_dp_rank = (dist.get_rank() // (self.plan.tp * self.plan.ulysses_size)) % self.plan.dp
        self.dp_rank = self.replica.index if self.replica is not None else grid_dp_rank
        self.sp_rank = dist.get_rank() % self.plan.ulysses_size
        self._mesh: DeviceMesh | None = None  # made in boost(), after the model is checked against the plan
        self._grad_mesh: DeviceMesh | None = None
        shares = self.plan.shares()
        # Each rank's loss is a mean over its own samples; weight it by its share so the
        # averaged gradient is the gradient of the mean over the whole global batch.
        self.loss_weight = shares[self.dp_rank] * len(shares) / sum(shares)
        self.scaler = DynamicLossScaler() if self.plan.precision == "fp16" else None
        self._model: nn.Module | None = None
        self._optimizer: BoostedOptimizer | None = None
        emulate = emulate or os.environ.get("TESSERA_EMULATE") or None
        device = self.plan.device_of(dist.get_rank())
        self.emulator = Emulator.from_environment(emulate, device, self.plan.precision) if emulate else None
        if self.emulator is not None:
            self.emulator.recompute_full = self.plan.recompute == "full"
        self._pipeline: PipelineRunner | None = None
        self._tied: TiedWeights | None = None
        self._layer_sync: LayerSync | None = None
        self._replica_group: dist.ProcessGroup | None = None

    # ------------------------------------------------------------------ boost
    def boost(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, BoostedOptimizer | None]:
        """Lay ``model`` and ``optimizer`` out as the Plan says; use the returned pair from now on."""
        if not isinstance(model, nn.Module):
            raise PlanError(f"boost() needs a torch.nn.Module, got {type(model).__name__}.")
        if self._model is not None:
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
        if self.emulator is not None:  # hooks on the blocks survive splitting, tp and FSDP wrapping
            self.emulator.slow_down(data_parallel.repeated_blocks(model))
            self.emulator.track_activations(model.parameters())
        if self.plan.replicas is not None:
            wrapped = self._boost_replica(model, list(names.values()))
        elif self.plan.pp > 1:
            # Tied weights are read here, before tp or FSDP replace parameters per module and hide the sharing.
            wrapped = self._boost_pipeline(model, [n for n in names.values() if len(n) > 1])
        else:
            if self.plan.tp > 1:
                policy_for(model).check_tp(model, self.plan.tp)  # before any group is created
                if not self.plan.offload:
                    model.to(self.device)
                split_gather = self.plan.sp > 1 and self.plan.sp_mode == "split_gather"
                apply_tensor_parallel(
                    model, model, self.mesh["tp"], sequence_parallel=split_gather, loss_parallel=self.plan.loss_parallel
                )
            if self.plan.ulysses_size > 1:
                policy_for(model).enable_ulysses(model, self.mesh.get_group("sp"))
            apply_recompute(data_parallel.repeated_blocks(model), self.plan.recompute)
            wrapped = data_parallel.apply_data_parallel(model, self.plan, self.grad_mesh, self.device)
            self._emulate_sharding(model)
            if self.emulator is not None and isinstance(wrapped, DistributedDataParallel):
                group = dist.get_process_group_ranks(self.grad_mesh.get_group())
                self.emulator.slow_links(wrapped, [self.plan.device_of(r) for r in group])
        self._model = wrapped
        if optimizer is None:
            return wrapped, None
        current = dict(data_parallel.unwrap(wrapped).named_parameters())
        # Under pipeline parallelism a rank keeps only its stages' parameters.
        groups = rebuild_optimizer(optimizer, lambda p: next((current[n] for n in names[id(p)] if n in current), None))
        build = optimizer_factory(optimizer)
        if self.plan.zero == 1:
            inner = ShardedOptimizer(groups, build, self.grad_mesh.get_group(), offload=self.plan.offload)
        else:
            inner = build(groups)
        self._optimizer = BoostedOptimizer(inner, list(wrapped.parameters()), self.scaler)
        return wrapped, self._optimizer

    def _boost_pipeline(self, model: nn.Module, tied: list[list[str]]) -> PipelineModel:
        """Cut ``model`` into this rank's stages, lay each out (tp, recompute, ZeRO) and build the schedule.
        ``tied``: the names of each parameter the model uses under several names."""
        policy = policy_for(model, "pipeline parallelism")
        layout = policy.pipeline_layout(model)
        if self.plan.tp > 1:
            policy.check_tp(model, self.plan.tp)
        pp_mesh = self.mesh["pp"]
        ranges = self.plan.pipeline.stage_ranges(len(model.get_submodule(layout.layers)), self.plan.pp)
        sp_group = self.mesh.get_group("sp") if self.plan.ulysses_size > 1 else None
        if sp_group is not None:  # on the whole model: attention modules and config are shared with the stages
            policy.enable_ulysses(model, sp_group)
        stages = split_model(model, layout, ranges, self.plan.pipeline.schedule, self.plan.pp, pp_mesh.get_local_rank())
        for _, stage in stages:
            stage.sp_group = sp_group  # positions start at this rank's sequence offset
            stage.to(self.device)
            if self.plan.tp > 1:
                apply_tensor_parallel(stage, model, self.mesh["tp"], loss_parallel=self.plan.loss_parallel)
            apply_recompute(data_parallel.repeated_blocks(stage), self.plan.recompute)
            data_parallel.apply_data_parallel(stage, self.plan, self.grad_mesh, self.device)
            self._emulate_sharding(stage)
        self._emulate_transfers(stages, dist.get_process_group_ranks(pp_mesh.get_group()), len(ranges))
        pipeline_model = PipelineModel(stages)
        self._tied = TiedWeights(tied, pipeline_model, layout, ranges, self.plan.pipeline.schedule, self.mesh)
        self._pipeline = PipelineRunner(
            pipeline_model, self.plan.pipeline, len(ranges), pp_mesh.get_group(), self.device
        )
        return pipeline_model

    def _boost_replica(self, model: nn.Module, names: list[list[str]]) -> nn.Module:
        """This rank's part of its replica under ``Plan.replicas``: the whole model, or one stage of
        the replica's pipeline. ``names``: every name of each parameter, in model order."""
        assert self.plan.replicas is not None and self.replica is not None
        replica = self.plan.replicas[self.replica.index]
        groups = replica_groups(self.plan)  # every rank makes every replica's group
        self._replica_group = groups[self.replica.index]
        layout = None
        if self.plan.pipelined:
            layout = policy_for(model, "replicas split into pipeline stages").pipeline_layout(model)
            n_layers = len(model.get_submodule(layout.layers))
            for i, other in enumerate(self.plan.replicas):
                try:
                    dataclasses.replace(self.plan.pipeline, stages=other.stages).check_layers(n_layers)
                except PlanError as exc:
                    raise PlanError(f"Plan.replicas[{i}]: {exc}") from None
        if replica.depth == 1:
            local, stages = model, [model]
        else:
            assert layout is not None
            split = split_model(
                model, layout, replica.stages, self.plan.pipeline.schedule, replica.depth, self.replica.stage
            )
            local, stages = PipelineModel(split), [stage for _, stage in split]
            self._emulate_transfers(split, list(self.replica.ranks), replica.depth)
        for stage in stages:
            stage.to(self.device)
            apply_recompute(data_parallel.repeated_blocks(stage), self.plan.recompute)
            data_parallel.apply_data_parallel(stage, self.plan, None, self.device)  # precision only: no wrapper
        if replica.depth > 1:
            assert isinstance(local, PipelineModel) and self._replica_group is not None
            spec = dataclasses.replace(self.plan.pipeline, stages=replica.stages)
            self._pipeline = PipelineRunner(local, spec, replica.depth, self._replica_group, self.device)
        self._layer_sync = LayerSync(
            self.plan, names, local, layout, self._emulate_layer_sync if self.emulator is not None else None
        )
        return local

    def _emulate_sharding(self, module: nn.Module) -> None:
        """Under emulation, FSDP's per-block collectives wait for the data-parallel group's slowest link."""
        if self.emulator is not None and data_parallel.uses_fsdp(self.plan):
            devices = [self.plan.device_of(r) for r in dist.get_process_group_ranks(self.grad_mesh.get_group())]
            self.emulator.slow_sharding(data_parallel.repeated_blocks(module), devices, self.plan.zero, root=module)

    def _emulate_transfers(self, stages: list[tuple[int, nn.Module]], ranks: list[int], n_stages: int) -> None:
        """Under emulation, each stage's activations and gradients wait for the link to its neighbour's device
        (``ranks``: the pipeline's global ranks in pipeline order)."""
        if self.emulator is None:
            return
        owners = stage_owners(len(ranks), n_stages, self.plan.pipeline.schedule)
        device = [self.plan.device_of(ranks[owners[i]]) for i in range(n_stages)]
        for i, stage in stages:
            self.emulator.slow_transfers(
                stage, device[i - 1] if i > 0 else None, device[i + 1] if i < n_stages - 1 else None
            )

    def _emulate_layer_sync(self, ranks: tuple[int, ...], nbytes: int) -> None:
        """Under emulation, one of the replicas' per-layer all-reduces waits for its holders' slowest link."""
        assert self.emulator is not None
        self.emulator.delay_all_reduce([self.plan.device_of(r) for r in ranks], nbytes)

    def _emulate_all_reduce(self, params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
        if self.emulator is not None:
            nbytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            self.emulator.delay_all_reduce(
                [self.plan.device_of(r) for r in dist.get_process_group_ranks(group)], nbytes
            )

    @property
    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks over which this rank's pipeline is spread (None when it holds the whole model)."""
        if self.plan.replicas is not None:
            return self._replica_group
        return self.mesh.get_group("pp") if self.plan.pp > 1 else None

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh: axes ("dp",), ("dp", "tp") or ("dp", "sp"), with "pp" first under pipelining."""
        if self.plan.replicas is not None:
            raise PlanError(
                "Plan.replicas has no device mesh: its replicas differ in depth, so ranks form no dp × pp grid."
            )
        if self._mesh is None:
            shape, names = [self.plan.dp], ["dp"]
            if self.plan.tp > 1:
                shape, names = [self.plan.dp, self.plan.tp], ["dp", "tp"]
            elif self.plan.ulysses_size > 1:
                shape, names = [self.plan.dp, self.plan.sp], ["dp", "sp"]
            if self.plan.pp > 1:  # outermost: stages talk point-to-point, the cheapest traffic for slow links
                shape, names = [self.plan.pp, *shape], ["pp", *names]
            self._mesh = init_device_mesh(self.device.type, tuple(shape), mesh_dim_names=tuple(names))
        return self._mesh

    @property
    def grad_mesh(self) -> DeviceMesh:
        """The 1-D mesh over which gradients are averaged: ``dp``, or dp × sp with sequence
        parallelism (sp ranks see different tokens of the same samples)."""
        if self.plan.ulysses_size == 1:
            return self.mesh["dp"]
        if self._grad_mesh is None:  # the dp and sp ranks of this pipeline position, as one axis
            self._grad_mesh = self.mesh["dp", "sp"]._flatten("dp_sp")
        return self._grad_mesh

    # --------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, optimizer: BoostedOptimizer | None = None) -> None:
        """``loss.backward()`` with the rank's share weighting and fp16 loss scaling."""
        if self._layer_sync is not None:
            raise PlanError(
                "Plan.replicas trains through booster.execute_pipeline(batch, model, loss_fn, optimizer), which "
                "also averages each layer's gradient over its holders; booster.backward alone would not."
            )
        self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.loss_weight != 1.0:
            loss = loss * self.loss_weight
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        with self.loss_parallel():
            loss.backward()
        self._check_emulated_memory()

    def _check_emulated_memory(self) -> None:
        if self.emulator is not None and self._model is not None:
            on_host = ()
            if self.plan.offload:  # as the cost model has it: ZeRO-2 keeps parameters, ZeRO-1 gradients too
                on_host = ("optimizer", "grads", "params")[: self.plan.zero]
            self.emulator.check_memory(self._model, self._optimizer, on_host)

    def loss_parallel(self) -> contextlib.AbstractContextManager[None]:
        """Compute the loss inside this context: with ``Plan.loss_parallel`` the logits are a DTensor
        split over the vocabulary and cross-entropy runs on the shards (torch's ``loss_parallel``);
        otherwise it does nothing, so the same loop serves every Plan.

        Example:
            >>> with booster.loss_parallel():
            ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            >>> booster.backward(loss, optimizer)
        """
        return loss_parallel() if self.plan.loss_parallel else contextlib.nullcontext()

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
        inputs, target = _inputs_and_target(batch)
        if self._pipeline is None:
            loss = self._accumulate(inputs, target, model, loss_fn)
        else:
            factor = self.loss_weight * (self.scaler.scale if self.scaler is not None else 1.0)
            with self.loss_parallel():
                loss = self._pipeline.step(inputs, target, loss_fn, factor)
            if self._tied is not None:
                self._tied.sync()
                if not data_parallel.uses_fsdp(self.plan):  # FSDP reduce-scatters inside the schedule
                    params, group = list(model.parameters()), self.grad_mesh.get_group()
                    if dist.get_world_size(group) > 1:
                        self._emulate_all_reduce(params, group)
                    average_gradients(params, group)
        if self._layer_sync is not None:
            self._layer_sync.sync()
        self._check_emulated_memory()
        return loss

    def _accumulate(
        self, inputs: torch.Tensor, target: torch.Tensor, model: nn.Module, loss_fn: Callable
    ) -> torch.Tensor:
        """Micro-batches as gradient accumulation (no pipeline): synchronise on the last one only."""
        n = self.plan.pipeline.microbatches
        check_microbatches(inputs.shape[0], n)
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), target.chunk(n))):
            with self.no_sync(model) if i < n - 1 else contextlib.nullcontext():
                with self.loss_parallel():
                    loss = loss_fn(model(x), y)
                self._backward(loss / n)
            total += distributed.local(loss.detach()).float()
        return total / n

    def clip_grad_norm(
        self, model: nn.Module, optimizer: BoostedOptimizer | None = None, max_norm: float = 1.0, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the global gradient norm over every shard; return that norm (before clipping)."""
        params = list(model.parameters())
        align_grad_placements(params)
        if self.scaler is not None and self.scaler.unscale_(params):
            return torch.tensor(float("inf"))  # overflow: the step will be skipped anyway
        # Pipeline stages hold disjoint parameters: their partial norms add up over the pp group
        # (a tied weight's copies are counted on one rank only).
        if self._layer_sync is not None:  # every gradient is counted once, by its lowest-ranked holder
            across: tuple[Any, ...] = (dist.group.WORLD,)
            uncounted = self._layer_sync.uncounted
        else:
            across = (self.mesh.get_group("pp"),) if self.plan.pp > 1 else ()
            uncounted = self._tied.uncounted if self._tied is not None else set()
        return clip_grads_(params, max_norm, norm_type, across=across, uncounted=uncounted)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (gradient accumulation); sync on the next backward outside it."""
        return data_parallel.no_sync(model)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss over the whole global batch (every rank gets the same value)."""
        value = distributed.local(loss.detach()).float() * self.loss_weight
        if self.replica is not None:  # each stage of a replica has its loss: count each replica once
            value /= self.plan.dp * len(self.replica.ranks)
            dist.all_reduce(value)
            return value
        value /= self.grad_mesh.size()
        dist.all_reduce(value, group=self.grad_mesh.get_group())
        return value

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
        sampler = ShareBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            global_batch_size,
            self.plan.shares(),
            self.dp_rank,
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


def _inputs_and_target(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a batch into (inputs, target): a pair, or a dict with x/input_ids and y/labels."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict):
        x = next((batch[k] for k in ("x", "input_ids") if k in batch), None)
        y = next((batch[k] for k in ("y", "labels") if k in batch), None)
        if x is not None and y is not None:
            return x, y
    keys = f" (keys: {', '.join(map(str, batch))})" if isinstance(batch, dict) else ""
    raise PlanError(
        f"execute_pipeline needs batches of (inputs, target) or dicts with 'x'/'input_ids' and 'y'/'labels', "
        f"got {type(batch).__name__}{keys}."
    )
