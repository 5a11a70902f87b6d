"""Compiled blocks (``Plan.compile="blocks"``): each repeated block's ``forward`` compiled on its own.

Regional compilation, as torchtitan does it: every block of a type runs the same code, so one compilation
(guarded on the block's type and shapes) serves them all, and compile time does not grow with depth. The
``forward`` is replaced in place, so parameter names (and so checkpoints) do not change, and hooks that
wrappers put on the module (FSDP2's gathers, DDP's) stay outside the compiled region. Applied after tensor
parallelism and recompute (the compiled region holds the recompute, traced as one checkpointed graph), before
data parallelism.

``fullgraph=True``: a block that does not compile as one graph is an error, not a silent fall back to eager.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from tessera.errors import PlanError

# The torch.compile backend (inductor unless set): "aot_eager" tells a compiler bug from a graph problem, and
# "eager" (dynamo's tracing alone) lets the GPU script's CPU mode run without minutes of C++ compilation.
BACKEND_ENV = "TESSERA_COMPILE_BACKEND"


def apply_compile(blocks: list[nn.Module], mode: str) -> None:
    """Compile the forward of every block in ``blocks`` (``mode``: ``"none"`` or ``"blocks"``)."""
    if mode == "none":
        return
    if not blocks:
        raise PlanError(
            'Plan.compile="blocks" found no transformer blocks (an nn.ModuleList of same-typed modules) in this '
            'model: use compile="none".'
        )
    backend = os.environ.get(BACKEND_ENV, "inductor")
    for block in blocks:
        compiled = torch.compile(block.forward, fullgraph=True, backend=backend)
        block.forward = _landing_inputs(compiled)  # type: ignore[method-assign]


def _landing_inputs(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` given plain copies of inputs still in flight from a collective (``AsyncCollectiveTensor``:
    what a tp layer's ``to_local`` returns after its redistribute, e.g. the vocabulary-parallel embedding's
    output). AOTAutograd takes such an input as a tensor subclass and, in torch 2.13, returns no gradient for
    it: the embedding's backward then fails deep inside DTensor. The copy waits for the collective, as the
    block's first operation would; only the first block's input is one."""

    @functools.wraps(compiled)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return compiled(*(_landed(a) for a in args), **{k: _landed(v) for k, v in kwargs.items()})

    return forward


def _landed(value: Any) -> Any:
    return value.clone() if isinstance(value, AsyncCollectiveTensor) else value


def compile_counts() -> dict[str, Any]:
    """This process's compilations so far: graphs compiled (first ones and recompilations alike) and the
    seconds spent compiling."""
    from torch._dynamo.utils import calculate_time_spent, counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "seconds": float(calculate_time_spent().get("total_wall_time", 0.0)),
    }


class RecompileWatch:
    """Compilations seen report by report. Blocks of fixed shapes compile once, at the first step; graphs
    compiled at ``storm_reports`` reports in a row mean the shapes change step after step, each change
    paying a compilation: that is warned of once, with the likely cause."""

    def __init__(self, storm_reports: int = 3) -> None:
        self.storm_reports = storm_reports
        start = compile_counts()  # (counters are the process's: another run may have compiled before)
        self.start, self.last = start, start["graphs"]
        self.reports = 0  # reports in a row that compiled something
        self.first = True

    def report(self) -> tuple[dict[str, float], str | None]:
        """This report's figures (``compile_s``: this run's seconds compiling so far; ``compiled_graphs``: its
        graphs so far) and a warning, once, when recompilations keep coming."""
        counts = compile_counts()
        new, self.last = counts["graphs"] - self.last, counts["graphs"]
        seconds = counts["seconds"] - self.start["seconds"]
        warning = None
        if self.first:  # the first report holds the first compilation
            self.first = False
        elif new:
            self.reports += 1
            if self.reports == self.storm_reports:
                warning = (
                    f"compiled blocks were compiled again at {self.reports} reports in a row ({self.graphs} "
                    f"graphs, {seconds:.1f} s compiling so far): the blocks' input shapes change from step "
                    "to step (sequences of varying length, a last batch of another size), and each new shape is "
                    "compiled. Pad or pack the data to data.seq_len, or use plan.compile: none."
                )
        else:
            self.reports = 0
        return {"compile_s": seconds, "compiled_graphs": self.graphs}, warning

    @property
    def graphs(self) -> int:
        """Graphs this run compiled up to its last report."""
        return self.last - self.start["graphs"]

    @property
    def seconds(self) -> float:
        """Seconds this run spent compiling (read now)."""
        return compile_counts()["seconds"] - self.start["seconds"]
