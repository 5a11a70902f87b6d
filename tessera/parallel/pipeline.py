"""Pipeline parallelism: cut a model into stages by its policy and run them with torch's schedules.

A stage (:class:`StageModule`) holds a range of the model's blocks plus, on the first stage,
the embeddings and, on the last, the final norm and head — under the model's own names
(``layers.5.attention.wq.weight`` stays ``layers.5.attention.wq.weight``), so checkpoints and
full state dicts are keyed exactly like the unsplit model. :class:`PipelineModel` is what
``Booster.boost`` returns: the union of this rank's stages (one, or several for interleaved
and V schedules). The schedules themselves are ``torch.distributed.pipelining``'s.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from tessera.distributed import local
from tessera.errors import NotSupportedYet, PlanError
from tessera.packing import records_mask
from tessera.parallel.policy import PipelineLayout
from tessera.parallel.tensor import align_grad_placements
from tessera.plan import SCHEDULES as PLAN_SCHEDULES
from tessera.plan import SINGLE_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, PipelineSpec

Ranges = tuple[tuple[int, int], ...]  # (first, end) layers of each stage

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
assert tuple(SCHEDULES) == PLAN_SCHEDULES, "one torch schedule class per name the Plan accepts"


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Attach ``module`` under ``root`` at the dotted ``path``, making empty containers on the way."""
    *parents, name = path.split(".")
    for part in parents:
        if part not in root._modules:
            root.add_module(part, nn.Module())
        root = root._modules[part]  # type: ignore[assignment]
    root.add_module(name, module)


def _merge(into: nn.Module, other: nn.Module) -> None:
    """Add ``other``'s submodules to ``into``, merging containers both have (e.g. two ranges of layers)."""
    for name, child in other.named_children():
        mine = into._modules.get(name)
        if mine is None and type(child) in (nn.Module, nn.ModuleDict):
            mine = type(child)()
            into.add_module(name, mine)
        if mine is None:
            into.add_module(name, child)
        else:
            _merge(mine, child)


class StageModule(nn.Module):
    """Blocks ``[first, end)`` of ``model`` and what the stage's position needs, under the model's names."""

    def __init__(self, model: nn.Module, layout: PipelineLayout, first: int, end: int, is_first: bool, is_last: bool):
        super().__init__()
        self.config = getattr(model, "config", None)
        self.sp_group = None  # pipeline stages see whole sequences
        self._stage_forward, self._packs, self._is_last = layout.forward, layout.packs, is_last
        for path in layout.every + (layout.first if is_first else ()) + (layout.last if is_last else ()):
            _place(self, path, model.get_submodule(path))
        blocks = model.get_submodule(layout.layers)
        _place(self, layout.layers, nn.ModuleDict({str(i): blocks[i] for i in range(first, end)}))
        for name in layout.buffers:  # e.g. rotary tables: not saved, rebuilt from the config
            self.register_buffer(name, getattr(model, name), persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Tokens (first stage) or hidden states in; logits (last stage) or hidden states out. Packed records
        come with their positions and ``documents`` (each token's record), passed on to the next stage."""
        if documents is None:
            return self._stage_forward(self, x)
        if not self._packs:
            raise NotSupportedYet(
                "packed records with pipeline stages need a Hugging Face model: use data.pack: false."
            )
        out = self._stage_forward(self, x, position_ids=position_ids, attention_mask=records_mask(documents))
        return out if self._is_last else (out, position_ids, documents)


def stage_owners(pp: int, n_stages: int, schedule: str) -> dict[int, int]:
    """Pipeline rank of each stage: stage s on rank s % pp (looped), or a V (rank r: r and 2pp-1-r).

    The same mapping torch's schedules use, so stages and schedule agree."""
    return generate_stage_to_rank_mapping(pp, n_stages, style="v" if schedule in V_SCHEDULES else "loop")


def split_model(
    model: nn.Module, layout: PipelineLayout, ranges: Ranges, schedule: str, pp: int, pp_rank: int
) -> list[tuple[int, StageModule]]:
    """This rank's stages of ``model`` (layer ``ranges`` per stage) as ``(stage index, module)`` pairs."""
    last = len(ranges) - 1
    return [
        (i, StageModule(model, layout, *ranges[i], is_first=i == 0, is_last=i == last))
        for i, owner in stage_owners(pp, len(ranges), schedule).items()
        if owner == pp_rank
    ]


def stage_of(name: str, layout: PipelineLayout, ranges: Ranges) -> int | None:
    """The stage that holds parameter ``name`` (None: a module every stage holds)."""
    if any(name.startswith(m + ".") for m in layout.first):
        return 0
    if any(name.startswith(m + ".") for m in layout.last):
        return len(ranges) - 1
    prefix = layout.layers + "."
    if name.startswith(prefix):
        layer = int(name[len(prefix) :].split(".")[0])
        return next(i for i, (first, end) in enumerate(ranges) if first <= layer < end)
    return None


class TiedWeights:
    """Parameters shared by stages on different ranks (tied input/output embeddings).

    Each rank holding a stage keeps its own copy; after every step their gradients are summed
    over the ranks that hold one (the true gradient of a shared weight is the sum of its uses),
    so the copies stay equal. Only the first holder counts the gradient in the global norm.
    """

    def __init__(
        self,
        tied: list[list[str]],
        local: nn.Module,
        layout: PipelineLayout,
        ranges: Ranges,
        schedule: str,
        mesh: DeviceMesh,
    ) -> None:
        owners = stage_owners(mesh.size(0), len(ranges), schedule)
        held = dict(local.named_parameters())
        grid = mesh.mesh  # global ranks, pp first
        self.synced: list[tuple[nn.Parameter, dist.ProcessGroup]] = []
        self.uncounted: set[int] = set()  # ids of copies another rank counts in the norm
        for names in tied:
            holders = sorted({owners[s] for n in names if (s := stage_of(n, layout, ranges)) is not None})
            if len(holders) < 2:  # one rank holds every use (V schedules): gradients meet locally ...
                if len({id(held[n]) for n in names if n in held}) > 1:  # ... unless wrapping split the tie
                    raise PlanError(
                        f"tied parameters {names} sit on two stages of one rank under schedule {schedule!r}, "
                        "and sharding each stage (tensor parallelism or ZeRO-2/3) made two copies that would drift "
                        "apart: use a looped schedule (1f1b, interleaved_1f1b, ...), or ZeRO-0/1 without tp."
                    )
                continue
            for coord in itertools.product(*(range(k) for k in grid.shape[1:])):
                ranks = [int(grid[(r, *coord)]) for r in holders]
                group = dist.new_group(ranks)  # every rank creates every group, in the same order
                if dist.get_rank() in ranks:
                    param = next(held[n] for n in names if n in held)
                    self.synced.append((param, group))
                    if dist.get_rank() != ranks[0]:
                        self.uncounted.add(id(param))

    @torch.no_grad()
    def sync(self) -> None:
        align_grad_placements(p for p, _ in self.synced)  # both copies' gradients laid out like the weight
        for param, group in self.synced:
            if param.grad is not None:
                dist.all_reduce(local(param.grad), group=group)


class PipelineModel(nn.Module):
    """This rank's pipeline stages, seen as one module keyed like the unsplit model.

    ``parameters()``, ``state_dict()`` and checkpoints cover exactly the stages this rank
    holds. Training goes through ``Booster.execute_pipeline``; calling the model directly
    is refused because a single stage cannot compute the model's output.
    """

    def __init__(self, stages: list[tuple[int, nn.Module]]) -> None:
        super().__init__()
        for _, stage in stages:
            _merge(self, stage)
        self.stage_modules = [stage for _, stage in stages]  # a plain list: not registered twice
        self.stage_ids = [i for i, _ in stages]

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise PlanError(
            "a pipeline-parallel model (Plan.pp > 1) runs through booster.execute_pipeline(batches, model, "
            "loss_fn, optimizer), which returns the loss; it cannot be called like the unsplit model."
        )


def check_microbatches(batch_size: int, microbatches: int) -> None:
    """Refuse a batch that does not split into equal micro-batches (their mean would not be the batch mean)."""
    if batch_size % microbatches:
        raise PlanError(
            f"the batch has {batch_size} samples, which Plan.pipeline.microbatches={microbatches} does not divide: "
            "make each rank's batch a multiple of the micro-batch count."
        )


def _nothing_left() -> Callable[[], None]:
    """The weight pass of a stage whose input pass already ran the whole backward."""
    return lambda: None


class PipelineRunner:
    """One training step over the micro-batches of a batch, with the Plan's schedule."""

    def __init__(
        self,
        model: PipelineModel,
        spec: PipelineSpec,
        n_stages: int,
        group: dist.ProcessGroup,
        device: torch.device,
        compiled: bool = False,
    ) -> None:
        self.spec = spec
        self.group = group
        # A compiled block's backward is one graph giving its input's and its weights' gradients together, so
        # the split schedules' input pass (which walks autograd's nodes to stop before the weights) cannot part
        # them: with compiled blocks the input pass is the whole backward and the weight pass has nothing left.
        whole = compiled and spec.schedule in SPLIT_BACKWARD_SCHEDULES
        self.stages = [
            PipelineStage(module, i, n_stages, device, group=group, dw_builder=_nothing_left if whole else None)
            for i, module in zip(model.stage_ids, model.stage_modules)
        ]
        self.holds_first = 0 in model.stage_ids
        self.holds_last = n_stages - 1 in model.stage_ids
        last_owner = stage_owners(dist.get_world_size(group), n_stages, spec.schedule)[n_stages - 1]
        self.last_rank = dist.get_global_rank(group, last_owner)
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if spec.schedule in SPLIT_BACKWARD_SCHEDULES and not whole:
            warnings.warn(
                f"schedule {spec.schedule!r}: under torch 2.13 its split backward leaves saved activations alive "
                "after every step when a stage's graph holds views or aliases (attention, norms); memory grows "
                "each step (docs/benchmarks.md). Prefer 1f1b or interleaved_1f1b for long runs.",
                stacklevel=3,
            )
        cls = SCHEDULES[spec.schedule]
        stages = self.stages[0] if spec.schedule in SINGLE_STAGE_SCHEDULES else self.stages
        # The loss is scaled by 1/microbatches here (scale_grads=False): torch's own scaling divides
        # every gradient after each step, which would shrink gradients accumulated over steps again.
        self.schedule = cls(stages, spec.microbatches, loss_fn=self._call_loss, scale_grads=False)

    def _call_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)

    def step(
        self,
        inputs: torch.Tensor,
        target: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        factor: float,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; the mean micro-batch loss, on every stage.

        ``factor`` multiplies each micro-batch loss before backward (share weight, fp16 scale);
        the returned loss is the user's, without it.
        """
        return self._run(inputs, target, loss_fn, factor, self.schedule.step)

    @torch.no_grad()
    def eval(
        self, inputs: torch.Tensor, target: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Forward only (the schedule's ``eval``): the mean micro-batch loss, on every stage."""
        if self.spec.schedule in V_SCHEDULES:
            raise NotSupportedYet(
                f"forward-only passes (evaluation) with schedule {self.spec.schedule!r} are not supported yet: "
                "torch 2.13's V schedules cannot run eval(); use 1f1b, interleaved_1f1b or interleaved_zero_bubble."
            )
        return self._run(inputs, target, loss_fn, 1.0, self.schedule.eval)

    def _run(
        self,
        inputs: torch.Tensor | dict[str, torch.Tensor],
        target: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        factor: float,
        run: Callable[..., Any],
    ) -> torch.Tensor:
        mb = self.spec.microbatches
        packed = isinstance(inputs, dict)  # packed records: tokens, positions and documents, stage to stage
        tokens = inputs["input_ids"] if packed else inputs
        check_microbatches(tokens.shape[0], mb)
        self._loss_fn = lambda out, tgt: loss_fn(out, tgt) * (factor / mb)
        losses: list[torch.Tensor] = []
        args = (tokens, inputs["position_ids"], inputs["documents"]) if packed else (inputs,)
        run(*(args if self.holds_first else ()), target=target if self.holds_last else None, losses=losses)
        device = tokens.device
        if self.holds_last:
            loss = torch.stack([local(x.detach()).float() for x in losses]).sum() / factor
        else:
            loss = torch.zeros((), device=device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss


@torch.no_grad()
def average_gradients(params: list[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average gradients that are replicated over ``group`` in one flat all-reduce.

    Used for DDP and ZeRO-1 under pipeline parallelism: the schedule runs the backward
    passes, so DDP's hooks cannot overlap the reduction; one bucket after the step is simple
    and works for every schedule (zero-bubble ones split backward in two).
    """
    grads = [local(p.grad) for p in params if p.grad is not None]  # tp shards: the dp ranks hold alike ones
    if not grads or dist.get_world_size(group) == 1:
        return
    sum_flat_(grads, group, divisor=dist.get_world_size(group))


@torch.no_grad()
def sum_flat_(grads: list[torch.Tensor], group: dist.ProcessGroup, divisor: float = 1.0) -> None:
    """Replace ``grads`` in place by their sum over ``group`` divided by ``divisor``, in one flat all-reduce."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat /= divisor
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
