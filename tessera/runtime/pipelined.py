"""A grid of pipeline stages: pp ranks per model copy, each stage laid out by ``parallelize``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.models.hf_experts import expert_modules
from tessera.parallel import data_parallel
from tessera.parallel.experts import expert_weights, reduce_expert_grad
from tessera.parallel.pipeline import (
    PipelineModel,
    PipelineRunner,
    TiedWeights,
    average_gradients,
    split_model,
    stage_owners,
)
from tessera.runtime.engine import Context, Engine, LossFn
from tessera.runtime.hooks import Hooks
from tessera.runtime.parallelize import enable_ulysses, parallelize


def announce_stages(
    hooks: Hooks, stages: list[tuple[int, nn.Module]], ranks: Sequence[int], n_stages: int, schedule: str
) -> None:
    """Tell ``hooks`` the neighbours of each of this rank's ``(index, stage)``; ``ranks``: the
    pipeline's global ranks in pipeline order, over which ``schedule`` places ``n_stages`` stages."""
    owner = stage_owners(len(ranks), n_stages, schedule)
    for i, stage in stages:
        previous = ranks[owner[i - 1]] if i > 0 else None
        following = ranks[owner[i + 1]] if i + 1 < n_stages else None
        hooks.on_stage(stage, previous, following)


def run_schedule(
    ctx: Context, runner: PipelineRunner, inputs: Any, target: torch.Tensor, loss_fn: LossFn
) -> torch.Tensor:
    """One batch through the pipeline schedule, each micro-batch loss weighted by this rank's share
    and the fp16 loss scale."""
    factor = ctx.loss_weight * (ctx.scaler.scale if ctx.scaler is not None else 1.0)
    ctx.weigh_layer_losses(factor / ctx.plan.pipeline.microbatches)
    with ctx.loss_parallel():
        return runner.step(inputs, target, loss_fn, factor)


class PipelineEngine(Engine):
    def wrap(self, model: nn.Module, names: list[list[str]]) -> nn.Module:
        ctx, plan = self.ctx, self.ctx.plan
        policy = ctx.require_policy("pipeline parallelism")
        layout = policy.pipeline_layout(model)
        if plan.tp > 1:
            policy.check_tp(model, plan.tp)
        pp_mesh = ctx.meshes.mesh["pp"]
        ranges = plan.pipeline.stage_ranges(len(model.get_submodule(layout.layers)), plan.pp)
        sp_group = ctx.meshes.group("sp") if plan.ulysses_size > 1 else None
        if sp_group is not None:  # on the whole model: attention modules and config are shared with the stages
            enable_ulysses(model, ctx.meshes, policy)
        stages = split_model(model, layout, ranges, plan.pipeline.schedule, plan.pp, pp_mesh.get_local_rank())
        for _, stage in stages:
            stage.sp_group = sp_group  # positions start at this rank's sequence offset
            parallelize(stage, plan, ctx.meshes, policy, ctx.hooks, ctx.device, model=model)
        pp_ranks = dist.get_process_group_ranks(pp_mesh.get_group())
        announce_stages(ctx.hooks, stages, pp_ranks, len(ranges), plan.pipeline.schedule)
        pipeline_model = PipelineModel(stages)
        tied = [n for n in names if len(n) > 1]
        self.tied = TiedWeights(tied, pipeline_model, layout, ranges, plan.pipeline.schedule, ctx.meshes.mesh)
        self.runner = PipelineRunner(
            pipeline_model, plan.pipeline, len(ranges), pp_mesh.get_group(), ctx.device, plan.compile != "none"
        )
        return pipeline_model

    def forward_backward(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        ctx = self.ctx
        loss = run_schedule(ctx, self.runner, inputs, target, loss_fn)
        self.tied.sync()
        if not data_parallel.uses_fsdp(ctx.plan):  # FSDP reduce-scatters inside the schedule
            experts = {id(p): p for p in expert_weights(expert_modules(model))}
            params = [p for p in model.parameters() if id(p) not in experts]
            group = ctx.meshes.grad.get_group()
            if dist.get_world_size(group) > 1:
                nbytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
                ctx.hooks.before_all_reduce(dist.get_process_group_ranks(group), nbytes)
            average_gradients(params, group)
            if ctx.plan.ep > 1:  # experts: summed over the ranks holding them, over dp
                assert ctx.plan.dp is not None
                for p in experts.values():
                    reduce_expert_grad(p, ctx.meshes.group("dp_rep"), ctx.plan.dp)
        return loss

    def evaluate(self, inputs: Any, target: torch.Tensor, model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
        with self.ctx.loss_parallel():
            return self.runner.eval(inputs, target, loss_fn)

    def norm_groups(self) -> tuple[tuple[Any, ...], Collection[int]]:
        # Stages hold disjoint parameters: their partial norms add up over the pp group (a tied
        # weight's copies are counted on one rank only).
        return (self.ctx.meshes.group("pp"),), self.tied.uncounted

    def state_group(self) -> dist.ProcessGroup | None:
        return self.ctx.meshes.group("pp")
