"""The runtime: what applies a resolved Plan to a model.

- :mod:`.parallelize`: one path for a module, the whole model or a pipeline stage alike
  (tensor parallel → recompute → data parallel / ZeRO).
- :mod:`.engine`: the protocol the Booster drives, and the per-step context; :func:`engine_for` picks one.
- :mod:`.flat`, :mod:`.pipelined`, :mod:`.replicated`: the engines; :mod:`.microbatches`: a batch's
  micro-batches as gradient accumulation (no pipeline).
- :mod:`.hooks`: neutral hook points (emulation listens there), :mod:`.meshes`: the device meshes,
  :mod:`.optimizer`: the user's optimizer rebuilt on the laid-out parameters.
"""

from tessera.runtime.engine import Context, Engine
from tessera.runtime.flat import FlatEngine
from tessera.runtime.hooks import Hooks
from tessera.runtime.meshes import Meshes
from tessera.runtime.parallelize import parallelize
from tessera.runtime.pipelined import PipelineEngine
from tessera.runtime.replicated import ReplicasEngine

__all__ = [
    "Context",
    "Engine",
    "FlatEngine",
    "Hooks",
    "Meshes",
    "PipelineEngine",
    "ReplicasEngine",
    "engine_for",
    "parallelize",
]


def engine_for(ctx: Context) -> Engine:
    """The engine that runs ``ctx.plan``: replicas of different depth, a pipeline grid, or the whole model."""
    if ctx.plan.replicas is not None:
        return ReplicasEngine(ctx)
    return PipelineEngine(ctx) if ctx.plan.pp > 1 else FlatEngine(ctx)
