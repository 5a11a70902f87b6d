"""Points where the runtime lets an observer act, without knowing who listens.

The runtime calls these at fixed places of ``boost()`` and of every step; the base class does
nothing. Emulation (:class:`tessera.testbed.emulate.EmulationHooks`) is one listener: it slows
blocks and links down and checks memory, and the runtime knows nothing of clusters.

Example:
    >>> class CountBackwards(Hooks):
    ...     calls = 0
    ...     def after_backward(self, model, optimizer):
    ...         self.calls += 1
    >>> booster = tessera.Booster(tessera.DDP(), hooks=CountBackwards())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from tessera.plan import Plan


class Hooks:
    """No-op hook points; subclass and override the ones you need."""

    def bind(self, plan: Plan, rank: int) -> None:
        """The resolved Plan and this rank, before anything is built."""

    def describe(self) -> str | None:
        """One line saying what the hooks change (printed by the trainer), or None."""
        return None

    def node(self) -> str | None:
        """The node this rank plays, when the hooks play a cluster (links are classed by it), or None."""
        return None

    def on_model(self, model: nn.Module, blocks: Sequence[nn.Module]) -> None:
        """The user's model and its repeated blocks, before any split, tp or wrapping."""

    def on_sharded(self, module: nn.Module, blocks: Sequence[nn.Module], ranks: Sequence[int]) -> None:
        """``module`` (the model or a pipeline stage) was sharded (ZeRO-2/3) over ``ranks``."""

    def on_replicated(self, wrapped: nn.Module, ranks: Sequence[int]) -> None:
        """``wrapped`` (a DDP module) averages its gradients over ``ranks``."""

    def on_stage(self, stage: nn.Module, previous_rank: int | None, next_rank: int | None) -> None:
        """A pipeline stage of this rank receives activations from ``previous_rank`` and gradients
        from ``next_rank`` (None at the ends of the pipeline)."""

    def before_all_reduce(self, ranks: Sequence[int], nbytes: int) -> None:
        """An all-reduce of ``nbytes`` over ``ranks`` written by Tessera (not DDP's or FSDP's) starts."""

    def after_backward(self, model: nn.Module, optimizer: Any | None) -> None:
        """A backward pass (or a pipelined batch) finished."""
