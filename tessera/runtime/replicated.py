"""Replicas of different depth (``Plan.replicas``): each replica a whole model on one rank, split over
the tp ranks of one node, or a pipeline over several ranks; every piece of a layer's gradient averaged
over the ranks that hold it."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tessera.checkpoint.storable import STORE_WHOLE
from tessera.errors import PlanError
from tessera.parallel.pipeline import PipelineModel, PipelineRunner, split_model
from tessera.parallel.replicas import LayerSync, check_replica_tp, replica_groups, replica_ranks
from tessera.runtime.engine import Context, Engine, LossFn
from tessera.runtime.microbatches import accumulate, forward_only
from tessera.runtime.parallelize import parallelize
from tessera.runtime.pipelined import announce_stages, run_schedule


class ReplicasEngine(Engine):
    plain_backward = False  # each layer's gradient is averaged over its holders by the engine's step
    norm_pieces = True  # each piece counted by its lowest holder, a tp replica's shards among them

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        assert ctx.plan.replicas is not None
        self.replica = replica_ranks(ctx.plan, ctx.rank)
        self.group: dist.ProcessGroup | None = None
        self.runner: PipelineRunner | None = None

    def wrap(self, model: nn.Module, names: list[list[str]]) -> nn.Module:
        """This rank's part of its replica: the whole model, or one stage of the replica's pipeline."""
        ctx, plan = self.ctx, self.ctx.plan
        assert plan.replicas is not None
        replica = plan.replicas[self.replica.index]
        self.group = replica_groups(plan)[self.replica.index]  # every rank makes every replica's group
        layout = None
        if plan.pipelined:
            layout = ctx.require_policy("replicas split into pipeline stages").pipeline_layout(model)
            n_layers = len(model.get_submodule(layout.layers))
            for i, other in enumerate(plan.replicas):
                try:
                    dataclasses.replace(plan.pipeline, stages=other.stages).check_layers(n_layers)
                except PlanError as exc:
                    raise PlanError(f"Plan.replicas[{i}]: {exc}") from None
        tp_mesh = None
        if replica.tp > 1:  # this replica's own tensor parallelism, over its ranks (a whole model: depth 1)
            policy = ctx.require_policy(f"tensor parallelism in Plan.replicas[{self.replica.index}]")
            check_replica_tp(policy, model, plan)
            assert self.group is not None
            tp_mesh = DeviceMesh.from_group(self.group, ctx.device.type, mesh_dim_names=("tp",))
        if replica.depth == 1:
            local, stages = model, [model]
        else:
            assert layout is not None
            split = split_model(
                model, layout, replica.stages, plan.pipeline.schedule, replica.depth, self.replica.stage
            )
            local, stages = PipelineModel(split), [stage for _, stage in split]
            announce_stages(ctx.hooks, split, self.replica.ranks, replica.depth, plan.pipeline.schedule)
        for stage in stages:  # no grid, no wrapper: precision and recompute only
            parallelize(stage, plan, None, ctx.policy, ctx.hooks, ctx.device, model=model, tp_mesh=tp_mesh)
        if replica.depth > 1:
            assert isinstance(local, PipelineModel) and self.group is not None
            spec = dataclasses.replace(plan.pipeline, stages=replica.stages)
            self.runner = PipelineRunner(local, spec, replica.depth, self.group, ctx.device, plan.compile != "none")
        self.layer_sync = LayerSync(plan, names, local, layout, ctx.hooks.before_all_reduce)
        if any(r.tp > 1 for r in plan.replicas):  # shards here, whole tensors in a replica of another tp
            setattr(local, STORE_WHOLE, True)
        return local

    def forward_backward(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        ctx = self.ctx
        if self.runner is None:
            loss = accumulate(ctx, inputs, target, model, loss_fn)
        else:
            loss = run_schedule(ctx, self.runner, inputs, target, loss_fn)
        self.layer_sync.sync()
        return loss

    def evaluate(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        if self.runner is None:
            return forward_only(self.ctx, inputs, target, model, loss_fn)
        with self.ctx.loss_parallel():
            return self.runner.eval(inputs, target, loss_fn)

    def grad_group(self) -> dist.ProcessGroup | None:
        return None  # Plan.replicas refuses ZeRO: nothing shards over a group

    def norm_groups(self) -> tuple[tuple[Any, ...], Collection[int]]:
        return (dist.group.WORLD,), self.layer_sync.uncounted  # every gradient counted by its lowest holder

    def reduce_loss(self, value: torch.Tensor) -> torch.Tensor:
        # each stage of a replica has the replica's loss: count each replica once
        value /= self.ctx.plan.dp * len(self.replica.ranks)
        dist.all_reduce(value)
        return value

    def state_group(self) -> dist.ProcessGroup | None:
        return self.group

    def data_ranks(self) -> int:
        return self.ctx.plan.dp  # a layer's gradient is averaged over the replicas holding it

    def sum_over_data(self, value: torch.Tensor) -> torch.Tensor:
        value /= len(self.replica.ranks)  # every stage of a replica holds the replica's batch
        dist.all_reduce(value)
        return value
