"""What a live profile holds (``tessera cluster profile`` writes one as JSON): each rank's device, the links
timed between nodes, and the pairs timed for tensor parallelism and FSDP."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tessera.errors import PlanError
from tessera.planner.profile import Profile


@dataclass
class RankMeasurement:
    """One rank's device: its parts' times (a :class:`Profile`), optimizer speed and peak memory."""

    rank: int
    device: int  # the cluster device it played (file order)
    node: str
    device_type: str  # as declared in the cluster file
    profile: Profile
    optimizer_gbs: float  # bytes an AdamW step moves (16 per parameter) per second, on the device
    peak_bytes: int
    memory_source: str  # "cuda max allocated" or "process max RSS"
    host_optimizer_gbs: float = 0.0  # the same on this rank's host CPU (where offload would step it)
    # What FSDP's hooks and copies add on this device, per unit (a block, or the root) and pass (a
    # forward or a backward), measured on a one-rank mesh (no communication):
    fsdp_unit_s: float = 0.0
    comm_overlap: float = 1.0  # share of a concurrent all-reduce's time its compute did not lose (measure_comm_overlap)
    # One forward and backward of the whole model (seconds), timed at the profile's start and again at its end:
    # how far the device's own speed moved while it was measured (LiveProfile.spread).
    recheck_s: tuple[float, float] = (0.0, 0.0)

    def drift(self) -> float:
        """The relative change between this rank's two timings of the same pass (0 when not timed)."""
        first, last = self.recheck_s
        return abs(last / first - 1) if first > 0 and last > 0 else 0.0

    def block_s(self) -> float:
        """Forward plus backward of one block, summed over the profiled micro-batch sizes (one size's
        backward, a difference of two timings, is noisier than the sum)."""
        block = self.profile.layers["block"]
        return sum(block.forward_s.values()) + sum(block.backward_s.values())


@dataclass
class LinkMeasurement:
    """A link timed between two ranks: one-way latency and achieved bandwidth."""

    nodes: tuple[str, str]
    ranks: tuple[int, int]
    bandwidth_gbs: float
    latency_us: float
    # Bus bandwidth of an all-reduce between the two ranks: unlike a send, it includes what both members'
    # processors do for a collective (gloo copies and reduces on the CPU, a throttled one slowly). Shown,
    # not priced: rings of more ranks ran at the send rate (see _measured_link).
    all_reduce_gbs: float = 0.0
    burst_bytes: float = 0.0  # what the link passed at once after idling (burst_from_push)


@dataclass
class TensorParallelMeasurement:
    """The whole model's forward and backward per micro-batch size, plain on one rank and tensor
    parallel over ``ranks`` (two ranks of ``node``, the fastest node with two), timed together.

    What a tp block costs beyond its share of the compute and the all-reduces the link model
    prices (DTensor dispatch, smaller and slower matmuls, waiting for the partner at every
    blocking all-reduce) is derived from these by :func:`tensor_parallel_overhead`."""

    node: str
    ranks: tuple[int, ...]
    plain_s: dict[int, float]  # micro-batch size -> seconds, the unsharded model on one rank
    sharded_s: dict[int, float]  # the same, sharded over ``ranks``
    # Peak bytes a forward and backward allocates beyond what is held before it, at the largest size:
    plain_peak_bytes: int = 0
    sharded_peak_bytes: int = 0


@dataclass
class FsdpPairMeasurement:
    """The whole model's forward and backward at one sample, plain and under ``fully_shard`` (a unit per
    block and the root) over ``ranks``, two ranks of ``node`` (the fastest with two), timed together.

    A one-rank group (:attr:`RankMeasurement.fsdp_unit_s`) shows FSDP's hooks but not what a real group
    adds: copying every unit's parameters into the gather buffer and out of it, its gradients into the
    reduce-scatter buffer, and the collectives themselves on the compute thread (gloo). On the testbed
    ZeRO-2 on two ranks was predicted 23% fast from the one-rank figure, 12% from the pair's.
    :func:`fsdp_unit_overhead` derives the per-unit cost from it."""

    node: str
    ranks: tuple[int, ...]
    plain_s: float
    sharded_s: float
    # Where no node has two ranks, the pair is the two fastest ranks on two nodes: ``node`` is the slower
    # member's (whose timings these are: its partner waits for it, not the other way), ``across`` the other's.
    across: str = ""


@dataclass
class LiveProfile:
    """Everything one ``tessera cluster profile`` job measured."""

    model_key: str
    seq_len: int
    precision: str
    where: str  # "testbed <name>" or the machine(s) it ran on
    ranks: list[RankMeasurement]
    links: list[LinkMeasurement] = field(default_factory=list)
    collective_latency_us: float = 0.0  # one tiny all-reduce over every rank
    all_reduce_gbs: float = 0.0  # bus bandwidth of a gradient-sized all-reduce over every rank
    tensor_parallel: TensorParallelMeasurement | None = None  # None: no node has two ranks
    backend: str = "nccl"  # the collectives library the ranks ran (its links' Link.backend)
    fsdp_pair: FsdpPairMeasurement | None = None  # None: a single rank
    # Other processes' CPU load (cores, averaged) on the launching machine while it measured (quiet.CpuWatch)
    other_cpu_cores: float = 0.0

    @property
    def spread(self) -> float:
        """The profile's own run-to-run spread: the largest relative change of any rank's time for the same
        pass between the profile's start and end. Plans whose predicted steps differ by less are a tie to it."""
        return max((r.drift() for r in self.ranks), default=0.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def save(self, path: str | Path) -> Path:
        Path(path).write_text(self.to_json() + "\n")
        return Path(path)

    @staticmethod
    def record_other_load(path: str | Path, cores: float) -> None:
        """Write into the profile at ``path`` the other processes' load its launcher saw."""
        data = json.loads(Path(path).read_text())
        data["other_cpu_cores"] = round(cores, 3)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LiveProfile:
        try:
            data = json.loads(Path(path).read_text())
            ranks = [
                RankMeasurement(
                    **{**r, "profile": Profile.from_json(json.dumps(r["profile"])),
                       "recheck_s": tuple(r.get("recheck_s", (0.0, 0.0)))}
                )
                for r in data["ranks"]
            ]  # fmt: skip
            links = [
                LinkMeasurement(**{**k, "nodes": tuple(k["nodes"]), "ranks": tuple(k["ranks"])}) for k in data["links"]
            ]
            if (tp := data.get("tensor_parallel")) is not None:
                tp = TensorParallelMeasurement(
                    tp["node"],
                    tuple(tp["ranks"]),
                    {int(b): t for b, t in tp["plain_s"].items()},
                    {int(b): t for b, t in tp["sharded_s"].items()},
                    tp.get("plain_peak_bytes", 0),
                    tp.get("sharded_peak_bytes", 0),
                )
            if (pair := data.get("fsdp_pair")) is not None:
                pair = FsdpPairMeasurement(**{**pair, "ranks": tuple(pair["ranks"])})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(
                f"{path} is not a live profile ({type(exc).__name__}: {exc}): write one with `tessera cluster profile`."
            ) from None
        return cls(**{**data, "ranks": ranks, "links": links, "tensor_parallel": tp, "fsdp_pair": pair})
