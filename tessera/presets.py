"""Presets: one-line ways to get a Plan for common layouts.

Example:
    >>> ZeRO(stage=3, offload=True).zero
    3
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from tessera.cluster.spec import Cluster

from tessera.errors import PlanError
from tessera.plan import PipelineSpec, Plan
from tessera.plan.groups import Groups


def _shares(dp_shares: Sequence[int] | None) -> tuple[int, ...] | None:
    return tuple(dp_shares) if dp_shares is not None else None


def DDP(
    precision: str = "fp32",
    dp_shares: Sequence[int] | None = None,
    device: str = "auto",
    groups: Groups | None = None,
) -> Plan:
    """Plain data parallelism: every rank holds the whole model and optimizer (in each of ``groups``)."""
    return Plan(zero=0, precision=precision, dp_shares=_shares(dp_shares), device=device, groups=groups)


def ZeRO(
    stage: int = 3,
    offload: bool = False,
    precision: str = "fp32",
    dp_shares: Sequence[int] | None = None,
    device: str = "auto",
    groups: Groups | None = None,
) -> Plan:
    """ZeRO data parallelism: stage 1 shards optimizer state, 2 also gradients, 3 also parameters (over the
    data-parallel ranks of each of ``groups``, when given)."""
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise PlanError(f"ZeRO(stage={stage!r}): stage must be 1, 2 or 3 (use tessera.DDP() for stage 0).")
    return Plan(
        zero=stage, offload=offload, precision=precision, dp_shares=_shares(dp_shares), device=device, groups=groups
    )


def Hybrid(
    dp: int | None = None,
    tp: int = 1,
    pp: int = 1,
    sp: int | str = 1,
    sp_mode: str = "all_to_all",
    zero: int = 0,
    precision: str = "fp32",
    microbatches: int = 1,
    schedule: str = "1f1b",
    stages: Sequence[tuple[int, int]] | None = None,
    dp_shares: Sequence[int] | None = None,
    loss_parallel: bool = False,
    recompute: str = "none",
    device: str = "auto",
    **fields: Any,
) -> Plan:
    """Several parallel dimensions at once: dp × tp × pp (or × Ulysses sp), ZeRO over dp.

    ``sp="split_gather"`` is Megatron sequence parallelism inside the tp group (sp = tp);
    an integer ``sp`` with ``sp_mode="all_to_all"`` is Ulysses over ``sp`` more ranks.
    ``fields``: any other :class:`Plan` field (``offload=True``, ``placement=...``), as is.

    Example:
        >>> Hybrid(tp=2, zero=3).tp
        2
        >>> Hybrid(tp=2, sp="split_gather").sp
        2
    """
    if isinstance(sp, str):
        if sp != "split_gather":
            raise PlanError(f"Hybrid(sp={sp!r}): give sp='split_gather', or an integer sp with sp_mode='all_to_all'.")
        sp, sp_mode = tp, "split_gather"
    pipeline = PipelineSpec(
        stages=tuple(tuple(s) for s in stages) if stages is not None else None,
        microbatches=microbatches,
        schedule=schedule,
    )
    named = dict(dp=dp, tp=tp, pp=pp, sp=sp, sp_mode=sp_mode, zero=zero, precision=precision)
    named.update(dp_shares=_shares(dp_shares), loss_parallel=loss_parallel, recompute=recompute, device=device)
    return Plan.from_dict({**named, **fields, "pipeline": pipeline})


def Auto(
    cluster: Cluster | str | Path,
    model: nn.Module,
    global_batch_size: int,
    seq_len: int | None = None,
    precision: str = "fp32",
    pin_precision: bool = False,
    use_every_device: bool = False,
) -> Plan:
    """The planner's fastest Plan for ``model`` on ``cluster`` (a cluster file or :class:`Cluster`).

    Devices of different speed and memory get different work: uneven data-parallel shares,
    uneven pipeline stages, each device placed on the mesh (``Plan.placement``).
    ``precision="bf16"`` (or ``"auto"``) beside devices without bf16 plans fp16 with loss scaling
    unless ``pin_precision``. The Plan may leave the slowest devices out when they would cost more
    than they give (launch ``len(plan.placement)`` ranks then) unless ``use_every_device``.
    ``tessera plan`` shows the runners-up and why.

    Example:
        >>> plan = Auto(cluster="cluster.yaml", model=model, global_batch_size=64)
        >>> booster = Booster(plan)
    """
    from tessera.planner import plan_for

    best = plan_for(
        cluster,
        model,
        global_batch_size,
        seq_len=seq_len,
        precision=precision,
        top=1,
        pin_precision=pin_precision,
        use_every_device=use_every_device,
    )[0]
    for note in best.notes:  # e.g. fp16 chosen where a device has no bf16: the user should know
        warnings.warn(f"tessera.Auto: {note}", stacklevel=2)
    return best.plan
