"""The Plan package: what one training job's layout is, and where its ranks sit.

- :mod:`.fields`: the :class:`Plan` itself (its fields, their checks, JSON/YAML).
- :mod:`.pipeline`: pipeline stages (:class:`PipelineSpec`) and replicas of different depth (:class:`Replica`).
- :mod:`.groups`: groups of ranks that train apart and meet at an outer sync (:class:`Groups`).
- :mod:`.grid`: all rank arithmetic (resolve, coordinates, mesh shape, batch split, a group's own plan,
  the jobs a launch starts); :mod:`.checks`: the vocabulary and checks the fields share.

Nothing here imports torch: the launcher checks Plans before any rank starts.
"""

from tessera.plan.checks import (
    DEVICES,
    PRECISIONS,
    RECOMPUTE,
    ROUND_SCHEDULES,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    SP_MODES,
    SPLIT_BACKWARD_SCHEDULES,
    V_SCHEDULES,
)
from tessera.plan.fields import Plan
from tessera.plan.grid import Job, RankCoords, grid_coords, grid_order, split_batch
from tessera.plan.groups import Groups, InnerLayout
from tessera.plan.pipeline import PipelineSpec, Replica

__all__ = [
    "DEVICES",
    "PRECISIONS",
    "RECOMPUTE",
    "ROUND_SCHEDULES",
    "SCHEDULES",
    "SINGLE_STAGE_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES",
    "SP_MODES",
    "V_SCHEDULES",
    "Groups",
    "InnerLayout",
    "Job",
    "PipelineSpec",
    "Plan",
    "RankCoords",
    "Replica",
    "grid_coords",
    "grid_order",
    "split_batch",
]
