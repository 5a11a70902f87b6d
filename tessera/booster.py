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
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from tessera import distributed
from tessera.data.sharding import ShardedLoader, ShareBatchSampler
from tessera.errors import PlanError
from tessera.models.policies import policy_for
from tessera.optim.wrapper import BoostedOptimizer, optimizer_factory, rebuild_optimizer
from tessera.parallel import data as data_parallel
from tessera.parallel.grad_norm import clip_grads_
from tessera.parallel.recompute import apply_recompute
from tessera.parallel.tensor import apply_tensor_parallel
from tessera.parallel.zero1 import ShardedOptimizer
from tessera.plan import Plan
from tessera.precision import DynamicLossScaler


class Booster:
    """Applies one :class:`~tessera.Plan` to a model, its optimizer and its data."""

    def __init__(self, plan: Plan | None = None) -> None:
        plan = plan if plan is not None else Plan()
        if not isinstance(plan, Plan):
            raise PlanError(
                f"Booster(plan=...) needs a tessera.Plan (e.g. tessera.ZeRO(stage=2)), got {type(plan).__name__}."
            )
        plan.check_supported()
        # Validate everything that can be checked before touching a process group.
        self.device = distributed.pick_device(plan.device)
        distributed.init()
        self.plan = plan.resolve(dist.get_world_size())
        # Ranks are laid out (dp, tp) or (dp, sp) row-major, as init_device_mesh does: the ranks
        # of one tp or sp group are neighbours and share their samples.
        self.dp_rank = dist.get_rank() // (self.plan.tp * self.plan.sp)
        self.sp_rank = dist.get_rank() % self.plan.sp
        self._mesh: DeviceMesh | None = None  # made in boost(), after the model is checked against the plan
        self._grad_mesh: DeviceMesh | None = None
        shares = self.plan.shares()
        # Each rank's loss is a mean over its own samples; weight it by its share so the
        # averaged gradient is the gradient of the mean over the whole global batch.
        self.loss_weight = shares[self.dp_rank] * len(shares) / sum(shares)
        self.scaler = DynamicLossScaler() if self.plan.precision == "fp16" else None
        self._model: nn.Module | None = None

    # ------------------------------------------------------------------ boost
    def boost(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> tuple[nn.Module, BoostedOptimizer | None]:
        """Lay ``model`` and ``optimizer`` out as the Plan says; use the returned pair from now on."""
        if not isinstance(model, nn.Module):
            raise PlanError(f"boost() needs a torch.nn.Module, got {type(model).__name__}.")
        if self._model is not None:
            raise PlanError("this Booster already boosted a model: make one Booster per model.")
        names = {id(p): n for n, p in model.named_parameters()}
        if optimizer is not None:
            foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
            if foreign:
                raise PlanError(
                    f"the optimizer holds {len(foreign)} parameter(s) that are not in the model: "
                    "build the optimizer from model.parameters()."
                )
        if self.plan.tp > 1:
            policy_for(model).check_tp(model, self.plan.tp)  # before any group is created
            if not self.plan.offload:
                model.to(self.device)
            apply_tensor_parallel(model, self.mesh["tp"])
        if self.plan.sp > 1:
            policy_for(model).enable_ulysses(model, self.mesh.get_group("sp"))
        apply_recompute(data_parallel.repeated_blocks(model), self.plan.recompute)
        wrapped = data_parallel.apply_data_parallel(model, self.plan, self.grad_mesh, self.device)
        self._model = wrapped
        if optimizer is None:
            return wrapped, None
        current = dict(data_parallel.unwrap(wrapped).named_parameters())
        groups = rebuild_optimizer(optimizer, lambda p: current[names[id(p)]])
        build = optimizer_factory(optimizer)
        if self.plan.zero == 1 and self.plan.tp == 1:
            inner = ShardedOptimizer(groups, build, self.grad_mesh.get_group(), offload=self.plan.offload)
        else:
            inner = build(groups)
        return wrapped, BoostedOptimizer(inner, list(wrapped.parameters()), self.scaler)

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh: axes ("dp",), ("dp", "tp") or ("dp", "sp")."""
        if self._mesh is None:
            if self.plan.tp > 1:
                shape, names = (self.plan.dp, self.plan.tp), ("dp", "tp")
            elif self.plan.sp > 1:
                shape, names = (self.plan.dp, self.plan.sp), ("dp", "sp")
            else:
                shape, names = (self.plan.dp,), ("dp",)
            self._mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._mesh

    @property
    def grad_mesh(self) -> DeviceMesh:
        """The 1-D mesh over which gradients are averaged: ``dp``, or dp × sp with sequence
        parallelism (sp ranks see different tokens of the same samples)."""
        if self.plan.sp == 1:
            return self.mesh["dp"]
        if self._grad_mesh is None:
            self.mesh  # noqa: B018 -- the (dp, sp) groups first, in the same order on every rank
            self._grad_mesh = init_device_mesh(self.device.type, (self.plan.dp * self.plan.sp,), mesh_dim_names=("dp",))
        return self._grad_mesh

    # --------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, optimizer: BoostedOptimizer | None = None) -> None:
        """``loss.backward()`` with the rank's share weighting and fp16 loss scaling."""
        if self.loss_weight != 1.0:
            loss = loss * self.loss_weight
        if self.scaler is not None:
            loss = self.scaler.scale_loss(loss)
        loss.backward()

    def clip_grad_norm(
        self, model: nn.Module, optimizer: BoostedOptimizer | None = None, max_norm: float = 1.0, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip by the global gradient norm over every shard; return that norm (before clipping)."""
        params = list(model.parameters())
        if self.scaler is not None and self.scaler.unscale_(params):
            return torch.tensor(float("inf"))  # overflow: the step will be skipped anyway
        return clip_grads_(params, max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (gradient accumulation); sync on the next backward outside it."""
        return data_parallel.no_sync(model)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean loss over the whole global batch (every rank gets the same value)."""
        value = loss.detach().float() * self.loss_weight / self.grad_mesh.size()
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
        seq_slice = (self.sp_rank, self.plan.sp) if self.plan.sp > 1 else None
        return ShardedLoader(
            dataset, sampler, self.device, collate_fn=collate_fn, num_workers=num_workers, seq_slice=seq_slice
        )

    # ------------------------------------------------------------------ state
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full, unsharded parameters and buffers on the CPU, keyed like the original model."""
        out = {}
        for key, value in data_parallel.unwrap(model).state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[key] = value.detach().to("cpu", copy=True)
        return out
