"""The shape of a policy: a matcher, a size check and a tensor-parallel plan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from tessera.errors import PlanError


@dataclass(frozen=True)
class Policy:
    name: str
    matches: Callable[[nn.Module], bool]
    sizes: Callable[[nn.Module], dict[str, int]]  # sizes that tp must divide, by config name
    tp_plan: Callable[[nn.Module], dict[str, ParallelStyle]]  # module path (fnmatch-style) -> style
    tied_embeddings: Callable[[nn.Module], bool]
    ulysses: Callable[[nn.Module, object], None] | None = None  # route attention through Ulysses all-to-all

    def enable_ulysses(self, model: nn.Module, group: object) -> None:
        if self.ulysses is None:
            raise PlanError(
                f"Ulysses sequence parallelism (Plan.sp > 1) has no hook for {self.name} yet: use Plan.sp=1."
            )
        self.ulysses(model, group)

    def check_tp(self, model: nn.Module, tp: int) -> None:
        """Refuse a tensor-parallel degree the model's sizes cannot be split by."""
        for name, size in self.sizes(model).items():
            if size % tp:
                raise PlanError(f"Plan.tp={tp} does not divide {self.name} {name}={size}: choose a tp that divides it.")
        if tp > 1 and self.tied_embeddings(model):
            raise PlanError(
                f"Plan.tp={tp}: tied input/output embeddings are not supported with tensor parallelism yet; "
                "untie them or use tp=1."
            )
