"""The shape of a model policy, as the parallel code consumes it: a matcher, a size check, a
tensor-parallel plan and a pipeline layout. The policies themselves (one per model family) live in
:mod:`tessera.models.policies`; this package never imports them: the runtime hands one over."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from tessera.errors import PlanError


@dataclass(frozen=True)
class PipelineLayout:
    """Where a model can be cut into pipeline stages, by module path.

    The first stage holds ``first`` (embeddings), the last holds ``last`` (final norm, head),
    every stage holds ``every`` (parameter-free helpers such as a rotary embedding) and the
    root buffers named in ``buffers``; the blocks of ``layers`` are split by layer range.
    ``forward(stage, x)`` runs one stage: tokens in on the first, logits out on the last; with
    ``packs``, also ``forward(stage, x, position_ids=, attention_mask=)`` for packed records.
    """

    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    forward: Callable[..., torch.Tensor]
    every: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    check: Callable[[nn.Module], None] | None = None  # refuse models this layout cannot cut
    packs: bool = False  # forward takes packed records' positions and attention mask


@dataclass(frozen=True)
class Policy:
    """What one model family needs for every parallel layout, as data plus small hooks.

    ``tp_plan`` / ``sequence_parallel_plan`` map module paths to ``parallelize_module`` styles,
    ``pipeline`` says where stages can be cut, ``ulysses`` routes attention through the
    all-to-all, ``after_tp`` repairs what a tp plan changes (tied weights, local feature counts).
    No modeling file is copied: everything applies to the model as Hugging Face (or we) built it.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    sizes: Callable[[nn.Module], dict[str, int]]  # sizes that tp must divide, by config name
    tp_plan: Callable[[nn.Module], dict[str, ParallelStyle]]  # module path (fnmatch-style) -> style
    tied_embeddings: Callable[[nn.Module], bool]
    head: str  # module path of the output projection (its layout decides whether logits are gathered)
    ulysses: Callable[[nn.Module, object], None] | None = None  # route attention through Ulysses all-to-all
    pipeline: PipelineLayout | None = None
    # Run after the tp plan on the model or one of its pipeline stages: re-tie the input and output
    # embeddings (both vocabulary-sharded alike), adjust attributes that count local features.
    after_tp: Callable[[nn.Module, int], None] | None = None
    sequence_parallel_plan: Callable[[nn.Module], dict[str, ParallelStyle]] | None = None
    tp_check: Callable[[nn.Module], None] | None = None  # refuse models the tp plan cannot split

    def tensor_plan(
        self, model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False
    ) -> dict[str, ParallelStyle]:
        """The ``parallelize_module`` plan: plain tensor parallelism or with split/gather sequence
        parallelism; with ``loss_parallel`` the head keeps its output split over the vocabulary."""
        if not sequence_parallel:
            plan = self.tp_plan(model)
        elif self.sequence_parallel_plan is None:
            raise PlanError(
                f"split/gather sequence parallelism (Plan.sp_mode='split_gather') has no plan for {self.name} yet: "
                "use Plan.sp=1, or sp_mode='all_to_all'."
            )
        else:
            plan = self.sequence_parallel_plan(model)
        if loss_parallel:
            gathered = plan[self.head]
            plan[self.head] = ColwiseParallel(
                input_layouts=gathered.input_layouts[0], output_layouts=Shard(-1), use_local_output=False
            )
        return plan

    def pipeline_layout(self, model: nn.Module) -> PipelineLayout:
        """The pipeline layout, after refusing models it cannot cut."""
        if self.pipeline is None:
            raise PlanError(f"pipeline parallelism (Plan.pp > 1) has no layout for {self.name} yet: use Plan.pp=1.")
        if self.pipeline.check is not None:
            self.pipeline.check(model)
        return self.pipeline

    def enable_ulysses(self, model: nn.Module, group: object) -> None:
        if self.ulysses is None:
            raise PlanError(
                f"Ulysses sequence parallelism (Plan.sp > 1) has no hook for {self.name} yet: use Plan.sp=1."
            )
        self.ulysses(model, group)

    def check_tp(self, model: nn.Module, tp: int) -> None:
        """Refuse a tensor-parallel degree the model's sizes cannot be split by."""
        if tp > 1 and self.tp_check is not None:
            self.tp_check(model)
        for name, size in self.sizes(model).items():
            if size % tp:
                raise PlanError(f"Plan.tp={tp} does not divide {self.name} {name}={size}: choose a tp that divides it.")
        if tp > 1 and self.tied_embeddings(model) and self.after_tp is None:
            raise PlanError(
                f"Plan.tp={tp}: tied input/output embeddings are not supported with tensor parallelism yet; "
                "untie them or use tp=1."
            )
