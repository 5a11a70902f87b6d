"""Which precision a plan computes in on a cluster: half precision where every device has a fast path.

bf16 asked for (or ``"auto"``) on a cluster where some device has no bf16 figure but every one
has fp16 (a V100 or T4 beside A100s) is planned in fp16 with dynamic loss scaling, with a note
that says so. ``"auto"`` otherwise picks bf16 when every device has it, and fp32 when some device
has no half precision at all. A *pinned* precision is kept as asked: a device without it is then
the error of :func:`tessera.planner.layout.unit_of`, naming the device and the way out.

Example:
    >>> choose_precision(Cluster.load("a100-and-v100.yaml"), "bf16")
    ('fp16', 'fp16 with dynamic loss scaling: V100 has no bf16 ...')
"""

from __future__ import annotations

from tessera.cluster.spec import Cluster
from tessera.errors import PlanError

CHOICES = ("auto", "fp32", "bf16", "fp16", "fp8")


def choose_precision(cluster: Cluster, requested: str, pinned: bool = False) -> tuple[str, str | None]:
    """(the precision to plan in, a note for the user or None) for ``requested`` on ``cluster``."""
    if requested not in CHOICES:
        raise PlanError(f"precision={requested!r} is not one of {', '.join(CHOICES)}.")
    if pinned and requested == "auto":
        raise PlanError('precision="auto" cannot be pinned: name fp32, bf16 or fp16 to pin it.')
    if pinned or requested in ("fp32", "fp16", "fp8"):  # (fp8: a device without an fp8 figure is refused)
        return requested, None
    types = {t.name: t for _, _, t in cluster.devices()}
    no_bf16 = sorted(name for name, t in types.items() if t.peak("bf16") is None)
    if not no_bf16:
        return "bf16", None
    no_fp16 = sorted(name for name, t in types.items() if t.peak("fp16") is None)
    if not no_fp16:
        return "fp16", (
            f"fp16 with dynamic loss scaling: {_listed(no_bf16)} no bf16 fast path (pin the precision, "
            "e.g. tessera plan --pin-precision, to refuse these devices instead)"
        )
    if requested == "bf16":
        return requested, None  # no half precision everywhere: the layout's error names the device
    return "fp32", f"fp32: {_listed(no_fp16)} no half-precision figure"


def _listed(names: list[str]) -> str:
    return f"{', '.join(names)} {'has' if len(names) == 1 else 'have'}"
