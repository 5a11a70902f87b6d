"""The optimizer the Booster hands back: the user's optimizer, layout-aware.

It is a ``torch.optim.Optimizer`` (so LR schedulers accept it) that delegates
to the real one — the user's class rebuilt on the wrapped model's parameters,
or a ZeRO-1 ShardedOptimizer — and, for fp16, skips a step whose gradients
overflowed.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.checkpoint.parts import Part, Shelf
from tessera.errors import PlanError
from tessera.parallel.tensor import align_grad_placements
from tessera.precision import DynamicLossScaler


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, new_param: Callable[[nn.Parameter], nn.Parameter | None]
) -> list[dict[str, Any]]:
    """The optimizer's param groups with every parameter replaced by ``new_param(p)``; parameters
    for which it returns None (held by another pipeline stage) are left out."""
    if optimizer.state:
        raise PlanError(
            "boost() needs an optimizer that has not stepped yet (its state is not empty): create the "
            "optimizer, boost, then train; to continue a run, load a checkpoint after boost()."
        )
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [q for p in group["params"] if (q := new_param(p)) is not None],
        }
        for group in optimizer.param_groups
    ]


def optimizer_factory(optimizer: torch.optim.Optimizer) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    """A function building the same optimizer class, with the same defaults, on new param groups."""
    cls = type(optimizer)
    signature = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    # Some defaults are not constructor arguments (AdamW's decoupled_weight_decay): the
    # param groups carry every value anyway, so pass only what the constructor accepts.
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in signature}

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        try:
            return cls(groups, **defaults)
        except TypeError as exc:
            raise PlanError(
                f"cannot rebuild {cls.__name__} on the sharded parameters ({exc}); its constructor must "
                "accept (params, **optimizer.defaults) like torch.optim optimizers do."
            ) from None

    return build


class BoostedOptimizer(torch.optim.Optimizer):
    """Wraps the real optimizer; ``step``, ``zero_grad`` and ``param_groups`` work as usual."""

    def __init__(
        self,
        inner: Any,
        model_params: list[nn.Parameter],
        scaler: DynamicLossScaler | None = None,
        state: Part | None = None,
    ) -> None:
        """``state``: the inner optimizer's part of a checkpoint (:mod:`tessera.checkpoint.parts`); what
        attaches itself later adds its own (:meth:`add_checkpoint_state`)."""
        # Deliberately no super().__init__: all state lives in ``inner``.
        self.inner = inner
        self.model_params = model_params
        self.scaler = scaler
        self._optimizer_step_pre_hooks = OrderedDict()  # type: ignore[assignment]
        # register_step_post_hook's: run after every step, skipped or not (the outer sync across Plan.groups,
        # the experts' loss-free balancing bias)
        self._optimizer_step_post_hooks = OrderedDict()  # type: ignore[assignment]
        self.skipped_steps = 0
        self._parts: dict[str, Part] = {"optim": state} if state is not None else {}
        self._shelf = Shelf()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise NotImplementedError("Tessera optimizers do not take a closure: compute the loss before step().")
        align_grad_placements(self.model_params)
        overflow = False
        if self.scaler is not None:
            overflow = self.scaler.unscale_(self.model_params)
            self.scaler.update()
            if overflow:
                self.skipped_steps += 1  # parameters and optimizer state stay untouched
        if not overflow:
            self.inner.step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def checkpoint_state(self) -> tuple[dict[str, Part], Shelf]:
        """What a checkpoint holds of this optimizer and what is attached to it, by name, and where this rank's
        state sits in it (:func:`tessera.checkpoint.save_checkpoint` asks)."""
        return dict(self._parts), self._shelf

    def add_checkpoint_state(self, name: str, part: Part, shelf: Shelf | None = None) -> None:
        """Keep ``part`` in this optimizer's checkpoints under ``name``; ``shelf``: where the whole state then
        sits (the outer sync of Plan.groups moves it into its group's folder)."""
        if name in self._parts:
            raise PlanError(f"the optimizer's checkpoint state already holds {name!r}.")
        self._parts[name] = part
        if shelf is not None:
            self._shelf = shelf

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise PlanError("add parameter groups before boost(): the optimizer is already laid out for the Plan.")

    def __repr__(self) -> str:
        return f"BoostedOptimizer({self.inner!r})"
