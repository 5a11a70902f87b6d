"""The Plan: a plain, serialisable description of how one training job is laid out.

Presets and the planner produce Plans; the runtime only reads them. A Plan is a frozen dataclass
tree that validates itself on construction and round-trips through JSON and YAML. This module holds
its fields and their checks; where ranks sit for a Plan is :mod:`tessera.plan.grid`'s to say (the
methods that ask are one-line doors to it).

Example:
    >>> plan = Plan(zero=3, precision="bf16", dp_shares=(3, 1))
    >>> Plan.from_json(plan.to_json()) == plan
    True
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.errors import NotSupportedYet, PlanError
from tessera.inputs import InputError, as_tuple, load_yaml, read_text, shown
from tessera.plan import grid
from tessera.plan.checks import (
    COMPILE,
    DEVICES,
    FP8_RECIPES,
    MAX_COUNT,
    MAX_GROUP,
    MAX_STAGES,
    PRECISIONS,
    RECOMPUTE,
    SINGLE_STAGE_SCHEDULES,
    SP_MODES,
    check_choice,
    check_int,
    check_positive_ints,
    from_mapping,
)
from tessera.plan.grid import RankCoords
from tessera.plan.groups import Groups
from tessera.plan.pipeline import PipelineSpec, Replica, replicas_from


@dataclass(frozen=True)
class Plan:
    """How one training job is laid out over the ranks of a process group.

    Fields:
        dp: data-parallel size; ``None`` fills every rank left by tp × pp × sp.
        tp, pp, sp: tensor-, pipeline- and sequence-parallel sizes.
        ep: expert-parallel size: the experts of each MoE layer split over ``ep`` neighbouring
            data-parallel ranks (tokens go to their experts' ranks and back by all-to-all); it divides
            dp, adds no ranks, and expert weights are averaged over the dp / ep ranks that hold the same.
        expert_shares: with ep, how many experts of each MoE layer each ep rank holds (in ep order;
            they sum to the layer's experts), e.g. ``(3, 3, 1, 1)`` for 8 experts on ranks of speed
            1, 1, ½, ½; ``None``: experts / ep each.
        sp_mode: ``"split_gather"`` (Megatron: activations split along the sequence over the tp
            ranks outside attention and MLP; needs sp == tp and adds no ranks) or
            ``"all_to_all"`` (Ulysses: sp more ranks, each holding a slice of every sequence).
        zero: ZeRO stage 0–3 over the data-parallel axis (0 is plain DDP).
        offload: keep sharded state on the CPU between uses.
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` (dynamic loss scaling) or ``"fp8"`` (bf16, with the
            blocks' linear layers in float8 through torchao: :mod:`tessera.parallel.float8`).
        fp8_recipe: with fp8, torchao's scaling: ``"tensorwise"`` (one scale per tensor; FSDP2 then gathers
            the weights in float8) or ``"rowwise"`` (one per row: closer to bf16, a little slower).
        fp8_emulate: with fp8, emulate float8 matmuls with bf16 ones (same numerics): for a CPU or a GPU
            without FP8 tensor cores, which are otherwise refused; not faster than bf16.
        dp_shares: relative number of samples each data-parallel rank takes
            from every global batch, e.g. ``(3, 1)``; ``None`` means equal.
        pipeline: stage layer ranges, micro-batch count and schedule.
        recompute: activation recompute, ``"none"``, ``"selective"`` (every second block), ``"full"``
            (every block) or ``"ops"`` (every block at operator level: matmul and attention outputs kept,
            the element-wise work between them recomputed).
        compile: ``"none"`` (eager) or ``"blocks"``: each repeated block's forward compiled on its own with
            ``torch.compile`` (regional compilation: one compilation serves every block of a type, so
            compile time does not grow with depth), after tensor parallelism and recompute, before data
            parallelism. Every layout and precision but expert parallelism (``ep``), refused by name.
        loss_parallel: with tp, keep the logits split over the vocabulary (a DTensor) and compute
            the cross-entropy on the shards under ``booster.loss_parallel()``: full logits are
            never gathered.
        device: ``"auto"`` (CUDA when present, else CPU), ``"cpu"`` or ``"cuda"``.
        rank_devices: optional device label per global rank (heterogeneous clusters).
        placement: the cluster device (its index in the cluster file's order) each rank runs on;
            the planner uses it to put each device where it belongs on the mesh (ranks are laid out
            row-major over pp, dp, tp|sp). ``None``: rank i runs on device i. A plan may leave devices
            out (the planner does when a slow device costs more than it gives): they are not named.
        replicas: data-parallel replicas whose pipelines differ in depth, or in tensor parallelism
            (:class:`Replica`), instead of dp × pp: replica i takes the next ``depth`` ranks, one
            stage each, or ``tp`` ranks splitting a whole model (tp per node kind), and every layer's
            gradient is averaged over the ranks that hold it. Needs Plan.tp = sp = pp = 1 and ZeRO-0;
            micro-batches and schedule come from ``pipeline``.
        groups: the ranks split into equal groups (regions) that train apart and meet at an outer
            synchronisation (:class:`~tessera.plan.groups.Groups`: DiLoCo, or none). Every other field
            lays out each group; ``dp`` and ``dp_shares`` are a group's.
    """

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1
    sp_mode: str = "all_to_all"
    zero: int = 0
    offload: bool = False
    precision: str = "fp32"
    fp8_recipe: str = "tensorwise"
    fp8_emulate: bool = False
    dp_shares: tuple[int, ...] | None = None
    expert_shares: tuple[int, ...] | None = None
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    recompute: str = "none"
    compile: str = "none"
    loss_parallel: bool = False
    device: str = "auto"
    rank_devices: tuple[str, ...] | None = None
    placement: tuple[int, ...] | None = None
    replicas: tuple[Replica, ...] | None = None
    groups: Groups | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dp_shares", as_tuple(self.dp_shares))
        object.__setattr__(self, "expert_shares", as_tuple(self.expert_shares))
        object.__setattr__(self, "rank_devices", as_tuple(self.rank_devices))
        object.__setattr__(self, "placement", as_tuple(self.placement))
        if isinstance(self.pipeline, dict):
            object.__setattr__(self, "pipeline", from_mapping(PipelineSpec, self.pipeline, "pipeline"))
        if self.replicas is not None:
            object.__setattr__(self, "replicas", replicas_from(self.replicas))
        if isinstance(self.groups, dict):
            object.__setattr__(self, "groups", from_mapping(Groups, self.groups, "groups"))
        if self.groups is not None and not isinstance(self.groups, Groups):
            raise PlanError(f"Plan.groups must be a mapping (count, sync, inner_steps, ...), got {shown(self.groups)}.")
        if self.groups is not None:
            for g in range(self.groups.count if self.groups.layouts is not None else 0):
                self.group_plan(g)  # each group's own layout is a Plan: checked now, named by its group
        if self.dp is not None:
            check_int("dp", self.dp)
        check_int("tp", self.tp, maximum=MAX_GROUP)
        check_int("pp", self.pp, maximum=MAX_STAGES)
        check_int("sp", self.sp, maximum=MAX_GROUP)
        check_int("ep", self.ep, maximum=MAX_GROUP)
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or not 0 <= self.zero <= 3:
            raise PlanError(f"Plan.zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}.")
        if not isinstance(self.offload, bool):
            raise PlanError(f"Plan.offload must be true or false, got {self.offload!r}.")
        if not isinstance(self.loss_parallel, bool):
            raise PlanError(f"Plan.loss_parallel must be true or false, got {self.loss_parallel!r}.")
        if self.loss_parallel and self.tp == 1:
            raise PlanError(
                "Plan.loss_parallel=True splits the logits over tensor-parallel ranks: it needs Plan.tp > 1."
            )
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        if not isinstance(self.fp8_emulate, bool):
            raise PlanError(f"Plan.fp8_emulate must be true or false, got {shown(self.fp8_emulate)}.")
        if self.precision != "fp8" and (self.fp8_recipe != "tensorwise" or self.fp8_emulate):
            raise PlanError(
                f"Plan.fp8_recipe and Plan.fp8_emulate apply to precision 'fp8', but "
                f"Plan.precision={self.precision!r}: set precision: fp8, or leave them out."
            )
        check_choice("sp_mode", self.sp_mode, SP_MODES)
        check_choice("recompute", self.recompute, RECOMPUTE)
        check_choice("compile", self.compile, COMPILE)
        check_choice("device", self.device, DEVICES)
        if not isinstance(self.pipeline, PipelineSpec):
            raise PlanError(f"Plan.pipeline must be a PipelineSpec, got {type(self.pipeline).__name__}.")
        if self.dp_shares is not None:
            check_positive_ints(
                "dp_shares",
                self.dp_shares,
                "every share must be a positive integer (a slow device gets a smaller share, never zero or less; "
                f"at most {MAX_COUNT})",
            )
            if self.dp is not None and len(self.dp_shares) != self.dp:
                raise PlanError(
                    f"Plan.dp_shares has {len(self.dp_shares)} entries but Plan.dp={self.dp}: "
                    "give one share per data-parallel rank."
                )
        if self.expert_shares is not None:
            self._check_expert_shares()
        if self.placement is not None and (
            not isinstance(self.placement, tuple)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.placement)
        ):
            raise PlanError(
                f"Plan.placement must be a list of cluster device indices (0, 1, ...), one per rank, "
                f"got {shown(self.placement)}."
            )
        if self.rank_devices is not None and (
            not isinstance(self.rank_devices, tuple) or not all(isinstance(d, str) for d in self.rank_devices)
        ):
            raise PlanError(
                f"Plan.rank_devices must be a list of device names, one per rank, got {shown(self.rank_devices)}."
            )
        if self.replicas is not None:  # before the grid checks below, whose advice would not apply
            self._check_replicas()
        stages = self.pipeline.stages
        if stages is not None and len(stages) % self.pp:
            raise PlanError(
                f"Plan.pipeline.stages lists {len(stages)} stages for Plan.pp={self.pp} ranks: give pp stages, "
                "or a multiple of pp for interleaved schedules (several stages per rank)."
            )
        self.pipeline.check_schedule(self.pp)
        if self.sp > 1 and self.sp_mode == "split_gather" and self.sp != self.tp:
            raise PlanError(
                f"Plan.sp={self.sp} with sp_mode='split_gather' must equal Plan.tp={self.tp}: Megatron sequence "
                "parallelism splits activations over the tensor-parallel ranks. Set sp=tp, or use "
                "sp_mode='all_to_all' (Ulysses) for sequence parallelism without tp."
            )
        if self.offload and self.zero == 0:
            raise PlanError(
                "Plan.offload=True needs a ZeRO stage (Plan.zero=1, 2 or 3): DDP keeps everything on the device."
            )

    def _check_expert_shares(self) -> None:
        """One positive count per ep rank (their sum is checked against the model's experts when it is laid out)."""
        shares = self.expert_shares
        check_positive_ints(
            "expert_shares", shares, f"every ep rank holds a positive number of experts (at most {MAX_COUNT})"
        )
        assert isinstance(shares, tuple)
        if len(shares) != self.ep:
            raise PlanError(
                f"Plan.expert_shares has {len(shares)} entries but Plan.ep={self.ep}: give the number of experts "
                "each expert-parallel rank holds, one entry per ep rank."
            )

    def _check_replicas(self) -> None:
        """Replicas of different depth replace dp × pp: the fields that describe a grid must stay unset."""
        assert self.replicas is not None
        for name, value, unset in (
            ("tp", self.tp, 1),
            ("pp", self.pp, 1),
            ("sp", self.sp, 1),
            ("ep", self.ep, 1),
            ("dp_shares", self.dp_shares, None),
            ("expert_shares", self.expert_shares, None),
            ("pipeline.stages", self.pipeline.stages, None),
        ):
            if value != unset:
                raise PlanError(
                    f"Plan.replicas lays out every rank itself, so Plan.{name} must stay {unset} (got {value!r}): "
                    "give each replica's stages and share in Plan.replicas instead."
                )
        if self.zero:
            raise NotSupportedYet(
                f"Plan.zero={self.zero} with Plan.replicas is not supported yet: each layer's gradient is averaged "
                "over the ranks that hold it, and sharding over those uneven groups is not written; use zero=0."
            )
        if self.dp is not None and self.dp != len(self.replicas):
            raise PlanError(
                f"Plan.dp={self.dp} but Plan.replicas lists {len(self.replicas)} replicas: leave Plan.dp unset."
            )
        if self.pipeline.schedule not in SINGLE_STAGE_SCHEDULES:
            raise PlanError(
                f"Plan.pipeline.schedule={self.pipeline.schedule!r}: replicas of different depth run one stage per "
                f"rank; use {' or '.join(SINGLE_STAGE_SCHEDULES)}."
            )
        ends = {r.stages[-1][1] for r in self.replicas}
        if len(ends) > 1:
            raise PlanError(
                f"Plan.replicas end at layers {sorted(ends)}: every replica must hold the whole model "
                "(its last stage ends at the model's last layer)."
            )
        for i, replica in enumerate(self.replicas):
            if replica.tp > 1 and replica.depth > 1:
                raise NotSupportedYet(
                    f"Plan.replicas[{i}] has tp={replica.tp} and {replica.depth} pipeline stages: tensor parallelism "
                    "inside a pipelined replica is not supported yet. Give the tp replica the whole model "
                    "(stages [[0, n_layers]]), or lay every replica out alike on a grid (Plan.tp with Plan.pp)."
                )
            if replica.depth > 1:
                try:
                    dataclasses.replace(self.pipeline, stages=replica.stages).check_schedule(replica.depth)
                except PlanError as exc:
                    raise PlanError(f"Plan.replicas[{i}]: {exc}") from None

    # ----------------------------------------------------------------- sizes
    @property
    def ulysses_size(self) -> int:
        """Ranks per Ulysses group: ``sp`` for all_to_all; 1 for split_gather, which reuses tp's ranks."""
        return self.sp if self.sp_mode == "all_to_all" else 1

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one replica of the model (tp × pp × Ulysses sp)."""
        return self.tp * self.pp * self.ulysses_size

    @property
    def pipelined(self) -> bool:
        """Whether some rank holds only part of the model (pipeline stages): training goes through
        ``Booster.execute_pipeline``."""
        return self.pp > 1 or (self.replicas is not None and any(r.depth > 1 for r in self.replicas))

    def check_composable(self) -> None:
        """Refuse (resolved) layouts whose pieces exist but do not compose yet; run by resolve()."""
        if self.groups is not None and self.groups.sync == "every_step" and (self.tp > 1 or self.ulysses_size > 1):
            raise NotSupportedYet(
                "Plan.groups.sync='every_step' with tensor or Ulysses sequence parallelism inside the groups is not "
                "supported yet: use data parallelism or ZeRO inside them, or sync: diloco."
            )
        if self.groups is not None and self.groups.sync == "every_step" and self.pp > 1:
            raise NotSupportedYet(
                "Plan.groups.sync='every_step' with pipeline stages inside the groups is not supported yet: use "
                "sync: diloco or streaming (each stage syncs its own layers), or no pipeline."
            )
        if self.ulysses_size > 1 and self.tp > 1:
            raise NotSupportedYet(
                f"Plan.sp={self.sp} (all_to_all) together with Plan.tp={self.tp} is not supported yet: use one, "
                "or sp_mode='split_gather' (sequence parallelism inside the tp group)."
            )
        if self.pp > 1 and self.sp > 1 and self.sp_mode == "split_gather":
            raise NotSupportedYet(
                f"Plan.pp={self.pp} with split/gather sequence parallelism is not supported yet: use "
                "sp_mode='all_to_all' (Ulysses) with pp, or split/gather without pp."
            )
        if self.pp > 1 and self.offload:
            raise NotSupportedYet(f"Plan.offload with Plan.pp={self.pp} is not supported yet: use offload=False.")
        if self.ep > 1:
            unsupported = {
                "offload": self.offload,
                "sp": self.sp > 1,
                "groups": self.groups is not None,
            }
            other = self._fields_in_use(unsupported)
            if other:
                raise NotSupportedYet(
                    f"Plan.ep={self.ep} with {', '.join(other)} is not supported yet: expert parallelism runs with "
                    "DDP or ZeRO-1/2/3, tensor parallelism and pipeline stages (no offload) for now; "
                    "use ep=1 for the others."
                )
        if self.tp > 1 and self.offload:
            raise NotSupportedYet(f"Plan.offload with Plan.tp={self.tp} is not supported yet: use offload=False.")
        if self.compile != "none":
            self._check_compilable()
        if self.precision == "fp8":
            self._check_float8()

    def _fields_in_use(self, used: dict[str, bool]) -> list[str]:
        """``Plan.<name>=<value>`` for each field of ``used`` whose condition holds, for a NotSupportedYet."""
        return [f"Plan.{name}={getattr(self, name)!r}" for name, on in used.items() if on]

    def _check_compilable(self) -> None:
        """Compiled blocks run (and are tested for parity) in every layout but expert parallelism (``ep``: its
        all-to-all sizes are known only at run time). Models with experts compile, their grouped GEMM an
        operator of the graph; the split-backward schedules run the compiled blocks' whole backward in their
        input pass."""
        other = self._fields_in_use({"ep": self.ep > 1})
        if other:
            raise NotSupportedYet(
                f"Plan.compile={self.compile!r} with {', '.join(other)} is not supported yet: compiled blocks run "
                "in every other layout (DDP, ZeRO-1/2/3 with offload, tensor and sequence parallelism, pipeline "
                "stages with every schedule, replicas and groups, models with experts without ep), in every "
                "precision; use compile='none' with expert parallelism."
            )

    def _check_float8(self) -> None:
        """FP8 runs (and is tested against bf16) with DDP, ZeRO-1/2/3, tensor parallelism and compiled blocks."""
        unsupported = {
            "pp": self.pp > 1,
            "sp": self.sp > 1,
            "ep": self.ep > 1,
            "replicas": self.replicas is not None,
            "groups": self.groups is not None,
            "offload": self.offload,
        }
        other = self._fields_in_use(unsupported)
        if other:
            raise NotSupportedYet(
                f"Plan.precision='fp8' with {', '.join(other)} is not supported yet: FP8 runs with DDP, ZeRO-1/2/3, "
                "tensor parallelism and compiled blocks for now; use precision 'bf16' for the others."
            )

    # ----------------------------------------------------------- rank arithmetic (tessera.plan.grid)
    def resolve(self, world_size: int) -> Plan:
        """This Plan with ``dp`` filled in for ``world_size`` ranks, checked (:func:`grid.resolve`)."""
        return grid.resolve(self, world_size)

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Sizes and names of the device mesh (:func:`grid.mesh_shape`)."""
        return grid.mesh_shape(self)

    def coords(self, rank: int) -> RankCoords:
        """Where ``rank`` sits (:func:`grid.coords`)."""
        return grid.coords(self, rank)

    def rank_at(self, coords: RankCoords) -> int:
        """The rank at ``coords`` (:func:`grid.rank_at`)."""
        return grid.rank_at(self, coords)

    @property
    def group_size(self) -> int:
        """Ranks per group (:func:`grid.group_size`)."""
        return grid.group_size(self)

    def device_of(self, rank: int) -> int:
        """The cluster device ``rank`` runs on (:func:`grid.device_of`)."""
        return grid.device_of(self, rank)

    def shares(self, dp: int | None = None) -> tuple[int, ...]:
        """Relative samples per data-parallel rank (:func:`grid.shares`)."""
        return grid.shares(self, dp)

    def samples_per_rank(self, global_batch_size: int) -> list[int]:
        """Samples per data-parallel rank of every global batch (:func:`grid.samples_per_rank`)."""
        return grid.samples_per_rank(self, global_batch_size)

    def batch_split(self, global_batch_size: int) -> list[int]:
        """Samples per data-parallel rank of the whole job, group after group (:func:`grid.batch_split`)."""
        return grid.batch_split(self, global_batch_size)

    def data_rank(self, rank: int) -> int:
        """Which entry of :meth:`batch_split` ``rank`` reads (:func:`grid.data_rank`)."""
        return grid.data_rank(self, rank)

    def replica_ranks(self, index: int) -> list[int]:
        """The ranks of replica ``index``, in stage order (:func:`grid.replica_ranks`)."""
        return grid.replica_ranks(self, index)

    def group_plan(self, group: int) -> Plan:
        """The Plan fault-tolerant group ``group`` runs as its own job (:func:`grid.group_plan`)."""
        return grid.group_plan(self, group)

    # --------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the Plan (tuples become lists), ready for JSON/YAML."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Build a Plan from a dict; unknown keys are errors naming the nearest valid key."""
        return from_mapping(cls, data, "")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(_parse(json.loads, json.JSONDecodeError, "JSON", text))

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> Plan:
        return cls.from_dict(_parse(lambda t: load_yaml(t, "Plan YAML"), InputError, "YAML", text))

    def save(self, path: str | Path, world_size: int | None = None) -> None:
        """Write the Plan as YAML (``.yaml``/``.yml``) or JSON (anything else); ``world_size``: the ranks it
        was made for, written first in the file (what to launch; a launch of another size is refused)."""
        path = Path(path)
        data = ({WORLD_KEY: world_size} if world_size is not None else {}) | self.to_dict()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(data, sort_keys=False))
        else:
            path.write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a Plan file (YAML, or JSON for other suffixes); every mistake names the file."""
        return cls.load_file(path)[0]

    @classmethod
    def load_file(cls, path: str | Path) -> tuple[Plan, int | None]:
        """A Plan file's Plan and the world size it records (None: it records none)."""
        try:
            text = read_text(path, "Plan file")
            if Path(path).suffix in (".yaml", ".yml"):
                data = _parse(lambda t: load_yaml(t, "Plan YAML"), InputError, "YAML", text)
            else:
                data = _parse(json.loads, json.JSONDecodeError, "JSON", text)
            world = data.pop(WORLD_KEY, None) if isinstance(data, dict) else None
            if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
                raise PlanError(
                    f"{WORLD_KEY}={world!r} is not a number of ranks: give a whole number, or leave it out."
                )
            return cls.from_dict(data), world
        except (InputError, PlanError) as exc:
            message = str(exc)
            raise PlanError(message if str(path) in message else f"Plan file '{path}': {message}") from None


WORLD_KEY = "world_size"  # in a Plan file beside the fields: the ranks it was made for


def _parse(load: Any, error: type[Exception], fmt: str, text: str) -> Any:
    try:
        return load(text)
    except RecursionError:
        raise PlanError(f"Plan {fmt} nests too deeply to be a Plan.") from None
    except error as exc:
        raise PlanError(f"Plan {fmt} is malformed: {str(exc)[:300]}") from None
