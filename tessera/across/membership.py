"""This job's membership of ``Plan.groups``: the one object through which the runtime meets the groups.

The Booster :func:`join`\\ s once and asks the :class:`Membership` what it needs, never reaching into it:

- the layout this job runs (the Plan resolved once, by :mod:`tessera.plan.grid`: a fault-tolerant group's
  own plan on its own ranks) and which group this rank trains in;
- the weights of its loss (its share of its group's batch; times its group's share of the global batch
  when gradients cross the groups every step) and its part of every global batch;
- the loss reported over the groups of one job;
- the outer sync (DiLoCo, Streaming DiLoCo, or islands that never meet), attached to the optimizer as a
  post-step hook (as torchft and torchtitan attach DiLoCo), with its checkpoint state as a part of the
  optimizer's checkpoint state, shelved in the group's own folder (:mod:`tessera.across.state`).

Without groups it is the trivial membership of one job: weights from the data-parallel shares alone,
nothing attached.

Example:
    >>> membership = join(plan, world=8, rank=dist.get_rank())
    >>> membership.plan.dp, membership.index
    (4, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.across.meet import Across
from tessera.across.outer import OuterSync
from tessera.across.state import GroupShelf, OuterState
from tessera.across.torchft import TorchftAcross, group_from_env
from tessera.errors import PlanError
from tessera.parallel import data_parallel
from tessera.plan import Plan, grid
from tessera.plan.grid import Job


def join(plan: Plan, world: int, rank: int) -> Membership:
    """The membership of rank ``rank`` of a job of ``world`` ranks laid out by ``plan``: the Plan resolved
    here, once (a fault-tolerant group's job reads which group it is from ``TESSERA_GROUP``)."""
    groups = plan.groups
    group = None
    if groups is not None and groups.fault_tolerant:
        group = group_from_env(groups.count)
    return Membership(grid.resolve_job(plan, world, group), rank)


class Membership:
    """Rank ``rank``'s place in ``job`` (a resolved :class:`~tessera.plan.grid.Job`) among its groups."""

    def __init__(self, job: Job, rank: int) -> None:
        self.job, self.rank = job, rank
        self.index = job.group_of(rank)  # the group this rank trains in (0 without groups)
        self.outer: OuterSync | None = None
        self.torchft: TorchftAcross | None = None  # how a fault-tolerant group meets the others
        self._syncs_reported = 0

    @property
    def plan(self) -> Plan:
        """The layout this job's ranks run, resolved (a fault-tolerant group's own)."""
        return self.job.plan

    @property
    def fault_tolerant(self) -> bool:
        """Whether each group is a job of its own, meeting the others through torchft."""
        return self.job.group is not None

    @property
    def share_weight(self) -> float:
        """This rank's share of its group's batch, relative to an even split."""
        return self.job.share_weight(self.rank)

    @property
    def loss_weight(self) -> float:
        """What this rank weighs its loss by (:meth:`~tessera.plan.grid.Job.loss_weight`)."""
        return self.job.loss_weight(self.rank)

    def batch_split(self, global_batch_size: int) -> tuple[list[int], int]:
        """Samples of every global batch per data rank, and which entry this rank reads."""
        return self.job.batch_split(global_batch_size, self.rank)

    def reduce_loss(self, value: torch.Tensor, group_axis: Any) -> torch.Tensor:
        """``value``, the mean loss of this group's batch, made the global batch's when the groups are one job
        (each group's mean weighted by its share, summed over ``group_axis``: a callable giving the mesh's
        ``group`` process group). Fault-tolerant groups meet only at outer syncs: their own mean stays."""
        if self.plan.groups is not None:
            value *= self.job.group_weights()[self.index]
            dist.all_reduce(value, group=group_axis())
        return value

    def refuse_token_mean(self) -> None:
        """A token mean over the global batch needs every group's count: refused under groups of one job."""
        if self.plan.groups is not None:
            raise PlanError(
                "token_mean_scale with Plan.groups is not supported yet: each group's optimizer would need the "
                "count of its own data only; average per sample instead, or train without groups."
            )

    def check_optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        """An outer sync follows the optimizer's steps: refuse ``boost()`` without one under groups."""
        if optimizer is None and self.job.groups is not None:
            raise PlanError(
                "Plan.groups synchronises the groups after their optimizer's steps: pass the optimizer to boost()."
            )

    # ------------------------------------------------------------------ the outer sync
    def attach(
        self, optimizer: Any, wrapped: nn.Module, names: Sequence[list[str]], meshes: Any, device: torch.device
    ) -> None:
        """Attach the outer sync to ``optimizer`` (the Booster's): after each of its steps, and in its
        checkpoints. ``wrapped``: the laid-out model; ``names``: every name of each parameter, in the whole
        model's order; ``meshes``: the runtime's meshes (the group's ranks, the gradient group, the group axis).
        Nothing without groups, or with ``sync: every_step`` (the gradients cross every step instead)."""
        groups = self.job.groups
        if groups is None or groups.sync == "every_step":
            return
        # groups that differ in size or layout meet in canonical slots, as many as the smallest has ranks
        slots = min(groups.sizes or (dist.get_world_size(),)) if groups.differ else None
        inside = meshes.inside
        if self.fault_tolerant:
            self.torchft = TorchftAcross.from_env(self.index, device.type, slots, inside)
        across: dist.ProcessGroup | Across = self.torchft if self.torchft is not None else meshes.group("group")
        module = data_parallel.unwrap(wrapped)
        blocks = {id(b) for b in data_parallel.repeated_blocks(module)}
        outer = OuterSync(
            dict(module.named_parameters()),
            across,
            groups,
            self.job.group_weights(),
            self.index,
            members=inside,
            blocks=[name for name, m in module.named_modules() if id(m) in blocks],
            holders=meshes.grad.get_group(),
            slots=slots,
            order=[every[0] for every in names],  # the whole model's, as every group cuts slots
        )
        if self.torchft is not None:
            self.torchft.attach(outer)
        self.outer = outer
        optimizer.register_step_post_hook(lambda *_: outer.after_inner_step())
        holds = [self.index] if self.fault_tolerant else list(range(groups.count))  # folders a checkpoint holds
        optimizer.add_checkpoint_state("outer", OuterState(outer), GroupShelf(self.index, groups.count, inside, holds))

    # ------------------------------------------------------------------ for the trainer
    @property
    def inner_step(self) -> int | None:
        """The outer sync's count of inner steps (a group that came back takes a live group's), or None."""
        return self.outer.step if self.outer is not None else None

    def new_syncs(self) -> list[dict[str, Any]]:
        """Under fault-tolerant groups, each outer sync since the last call: the groups in its quorum, whether
        this group healed from another, whether it committed."""
        syncs = self.torchft.syncs if self.torchft is not None else []
        new, self._syncs_reported = syncs[self._syncs_reported :], len(syncs)
        return list(new)
