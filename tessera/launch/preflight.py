"""Everything ``tessera train`` checks before any process starts or any file is written.

A mistake found here costs the user a second, not a launch: the config (parsed once) and its plan
(resolved once, into the jobs the launch starts), the batch split, the corpus, the model's size and
vocabulary (from its description, :mod:`tessera.models.described`), the plan's tp, sp and pp against the
model's shapes (on the model built on the meta device, only for such a plan: :mod:`tessera.models.fits`),
a memory estimate against this machine, the output directory and the run directory's owner, and the
checkpoint a resume would load (its trainer state, its model's shapes, its shards whole).

What the ranks would otherwise compute again is handed on: instruction records, tokenized here to name a
bad one before launch, are written to a file the ranks read (:meth:`Checked.handed`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera import trackers
from tessera.checkpoint import latest_checkpoint
from tessera.checkpoint.readers import read_meta, read_trainer_state
from tessera.config import Config, ConfigError, load_config, plan_from_config, planned_world_size
from tessera.data.held_out import check_held_out
from tessera.data.hf_dataset import dataset_data
from tessera.data.instructions import HANDED_ENV, InstructionData, records_key
from tessera.data.shards import TokenShards
from tessera.data.text import check_corpus_size, resolve_paths
from tessera.errors import PlanError
from tessera.inputs import check_output_dir
from tessera.launch import node_rank as node_rank_of
from tessera.launch.rundir import RUN_ID_ENV, refuse_if_taken
from tessera.models.described import parameter_count, tokenizer_for
from tessera.models.pretrained import check_base_of
from tessera.plan import V_SCHEDULES, Plan, grid
from tessera.plan.grid import Job

# Bytes per parameter a rank holds besides the weights it builds: fp32 gradients and Adam's two moments.
STATE_BYTES_PER_PARAM = 12
# What each tracker writes, as the banner says it.
TRACKER_OUTPUT = {"tensorboard": "TensorBoard events", "wandb": "W&B run in wandb/", "mlflow": "MLflow run"}


@dataclass
class Checked:
    """A checked launch: the config, parsed once; the jobs it starts, the Plan resolved once (one, or one per
    fault-tolerant group); and what the ranks are handed (``env``), kept in ``folder`` until :meth:`close`."""

    cfg: Config
    jobs: list[Job]
    env: dict[str, str] = field(default_factory=dict)
    folder: Path | None = None
    n_params: int = 0  # the base model's parameters, counted from its sizes

    def banner(self, nproc: int, nnodes: int) -> str:
        """What the launch is about to run, said once before it starts: the model and its size, the plan,
        the ranks, and where the run writes."""
        cfg, plan, groups = self.cfg, self.plan, self.jobs[-1].groups
        model = cfg.model.pretrained or cfg.model.hf_config or cfg.model.kind
        lora = f", LoRA r={cfg.model.lora.r}" if cfg.model.lora is not None else ""
        layouts = [_layout(job.plan) for job in self.jobs]
        shown = layouts[0] if len(set(layouts)) == 1 else "; ".join(f"group {g}: {t}" for g, t in enumerate(layouts))
        if groups is not None:
            kind = ", fault-tolerant, each its own job" if groups.fault_tolerant else ""
            shown += f" ({groups.count} groups, {groups.sync} sync{kind})"
        machines = f"{nproc} ranks" + (f" on each of {nnodes} machines" if nnodes > 1 else "")
        names = trackers.chosen(cfg.logging.trackers, cfg.logging.tensorboard)
        board = "".join(f", {TRACKER_OUTPUT[name]}" for name in names)
        if cfg.logging.trackers is None and cfg.logging.tensorboard and not names:
            board += "; TensorBoard off: pip install 'tessera[tensorboard]'"
        return "\n".join([
            f"tessera: {model} ({self.n_params / 1e6:,.2f}M parameters{lora}); plan {shown}, {plan.precision}; "
            f"{machines}; {cfg.train.steps} steps of {cfg.train.global_batch_size} sequences",
            f"tessera: writing {cfg.run_dir}/ (metrics.jsonl, loss.png, checkpoints/{board})",
        ])  # fmt: skip

    @property
    def plan(self) -> Plan:
        """The layout of the (last) job, resolved."""
        return self.jobs[-1].plan

    def handed(self, data: InstructionData, key: str) -> None:
        """Hand ``data`` (made from ``key``) to the ranks, which then read it instead of tokenizing again."""
        self.folder = Path(tempfile.mkdtemp(prefix="tessera-handed-"))
        data.save(self.folder / "instructions.pt", key)
        self.env[HANDED_ENV] = str(self.folder / "instructions.pt")

    def close(self) -> None:
        """Remove what was handed on (after the launch)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _layout(plan: Plan) -> str:
    """A plan's degrees and ZeRO stage in a few words (``dp=2, ZeRO-2``)."""
    degrees = [f"{k}={v}" for k, v in (("dp", plan.dp), ("tp", plan.tp), ("pp", plan.pp), ("sp", plan.sp),
                                       ("ep", plan.ep)) if v and v > 1]  # fmt: skip
    return ", ".join(degrees + ([f"ZeRO-{plan.zero}"] if plan.zero else [])) or "one rank"


def available_memory_bytes() -> int | None:
    """This machine's available memory (Linux MemAvailable), or None when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(cfg: Config, plan: Plan, nproc: int, n_params: int) -> None:
    """Refuse a model of ``n_params`` whose estimated state cannot fit on this machine, before any rank
    allocates it.

    Each local rank builds the whole model in fp32 before the plan shards it (a pretrained model: only
    the weights it holds, read once laid out), then keeps its share of gradients and optimizer state
    (divided over tp × pp, and over dp under ZeRO): a lower bound, since activations come on top.
    """
    shards = plan.tp * plan.pp * (plan.dp if plan.zero >= 1 else 1)
    held = plan.tp * plan.pp * (plan.dp if plan.zero >= 2 else 1) if cfg.model.pretrained else 1
    per_rank = 4 * n_params / held + STATE_BYTES_PER_PARAM * n_params / shards
    need, have = nproc * per_rank, available_memory_bytes()
    sizes = (
        f"model.pretrained={cfg.model.pretrained}"
        if cfg.model.pretrained
        else f"model.dim={cfg.model.dim}, n_layers={cfg.model.n_layers}, ffn_dim={cfg.model.ffn_dim}"
    )
    builds = "holds its share of the weights" if cfg.model.pretrained else "builds it whole"
    if have is not None and need > have:
        raise ConfigError(
            f"the model has {n_params / 1e6:,.1f}M parameters ({sizes}): each of the {nproc} ranks on this "
            f"machine {builds} and keeps its share of gradients and optimizer state, at least "
            f"{need / 2**30:,.1f} GiB in all, but only {have / 2**30:,.1f} GiB is available. Lower the model "
            "sizes, launch fewer ranks per machine, or shard more (plan.zero=3, plan.tp, plan.pp)."
        )


def check_training(
    config: str,
    overrides: list[str],
    nproc: int,
    nnodes: int,
    overwrite: bool,
    group: int | None = None,
    node_rank: int | None = None,
) -> Checked:
    """Validate a ``tessera train`` invocation; return the checked launch. Raises a ValueError naming the fix.
    ``group``: the launch is that group of fault-tolerant Plan.groups alone. ``node_rank``: this machine's
    place in the plan file's launch (:mod:`tessera.launch.node_rank`): its machines may differ in ranks."""
    cfg = load_config(config, overrides)
    world = nproc * nnodes
    handed: dict[str, str] = {}
    if node_rank is not None:
        if not cfg.plan.file:
            raise ConfigError("--node-rank places this machine in a planned launch: set plan.file to a `tessera plan` "
                              "output, or leave --node-rank out.")  # fmt: skip
        plan = plan_from_config(cfg.plan)
        if group is not None and plan.groups is not None:  # the group's own machines and ranks
            plan = plan.group_plan(group)
        first = node_rank_of.first_rank(plan, cfg.plan.file, node_rank, nproc, nnodes)
        world = (
            len(plan.rank_devices or ())
            if group is not None
            else planned_world_size(cfg.plan) or len(plan.rank_devices or ())
        )
        handed = {node_rank_of.FIRST_RANK_ENV: str(first), node_rank_of.NODE_RANK_ENV: str(node_rank)}
    if group is None and (recorded := planned_world_size(cfg.plan)) is not None and recorded != world:
        raise ConfigError(
            f"plan.file '{cfg.plan.file}' was made for {recorded} ranks (its world_size), but this launch starts "
            f"{world} ({nproc} per machine x {nnodes}): launch {recorded} ranks, or plan again for {world}."
        )
    try:
        jobs = grid.launch_jobs(plan_from_config(cfg.plan), world, cfg.train.global_batch_size, group)
    except PlanError as exc:
        raise ConfigError(f"plan (for {world} ranks): {exc}") from None
    checked = Checked(cfg, jobs)
    checked.env.update(handed)
    try:
        _check_data_and_model(checked, nproc)
        _check_run_directory(cfg, overwrite)
    except BaseException:
        checked.close()
        raise
    return checked


def _check_data_and_model(checked: Checked, nproc: int) -> None:
    cfg, plan = checked.cfg, checked.plan
    tokenizer = tokenizer_for(cfg)
    if cfg.data.instructions:  # every record read and tokenized here: a bad one is named before launch
        if plan.groups is not None:
            raise ConfigError("data.instructions with plan.groups is not supported yet: fine-tune without groups.")
        if cfg.data.pack and not cfg.model.kind.startswith("hf_"):
            raise ConfigError(
                "data.pack keeps records apart with an attention mask and per-record positions, which a Hugging "
                "Face model takes: use an hf_ model.kind or model.pretrained (or data.pack: false)."
            )
        d = cfg.data
        data = InstructionData(resolve_paths(d.instructions), tokenizer, d.seq_len, d.on_bad_record, pack=d.pack)
        check_held_out(len(data), d.validation, cfg.train.global_batch_size)
        checked.handed(data, records_key(d, cfg.model.pretrained))
    elif cfg.data.dataset is not None:  # read (and tokenized) here: a bad row or column is named before launch
        if plan.groups is not None:
            raise ConfigError("data.dataset with plan.groups is not supported yet: use data.prepared with groups.")
        d = cfg.data
        data = dataset_data(d.dataset, tokenizer, d.seq_len, d.max_bytes, d.on_bad_record, d.pack)
        check_held_out(len(data), d.validation, cfg.train.global_batch_size)
        if isinstance(data, InstructionData):  # the ranks read these tokens instead of tokenizing again
            checked.handed(data, records_key(d, cfg.model.pretrained))
    elif cfg.data.prepared:
        shards = TokenShards(cfg.data.prepared, cfg.data.seq_len)  # its index and shard sizes; nothing is read
        check_held_out(len(shards), cfg.data.validation, cfg.train.global_batch_size)
    else:
        check_corpus_size(resolve_paths(cfg.data.paths), cfg.data.seq_len, cfg.data.max_bytes)  # sizes only
    _check_experts(cfg, plan)
    _check_shapes(cfg, [job.plan for job in checked.jobs])  # each fault-tolerant group's own layout
    if cfg.model.lora is not None and cfg.model.lora.dropout > 0 and plan.tp > 1:
        raise ConfigError(
            f"model.lora.dropout={cfg.model.lora.dropout} with plan.tp={plan.tp}: tensor-parallel ranks would drop "
            "different features of the same input; set model.lora.dropout: 0 or plan.tp: 1."
        )
    if plan.precision == "fp8":  # on the device this machine's ranks will get
        from tessera.distributed import pick_device
        from tessera.parallel.float8 import fp8_problem

        if (problem := fp8_problem(pick_device(plan.device), plan.fp8_emulate)) is not None:
            raise ConfigError(problem)
    checked.n_params = parameter_count(cfg, tokenizer.vocab_size)
    check_memory(cfg, plan, nproc, checked.n_params)
    if cfg.eval.every and plan.pipelined and plan.pipeline.schedule in V_SCHEDULES:
        raise ConfigError(
            f"eval.every runs forward-only passes, which schedule {plan.pipeline.schedule!r} cannot (torch 2.13's V "
            "schedules have no eval()): use plan.schedule 1f1b, interleaved_1f1b or interleaved_zero_bubble, or "
            "eval.every: 0."
        )


def _check_run_directory(cfg: Config, overwrite: bool) -> None:
    check_output_dir(cfg.logging.out_dir, "logging.out_dir")
    if found := trackers.problems(trackers.chosen(cfg.logging.trackers, cfg.logging.tensorboard)):
        raise ConfigError("; ".join(found) + ".")
    if cfg.run_dir.exists() and not cfg.run_dir.is_dir():
        raise ConfigError(f"the run directory '{cfg.run_dir}' is a file: choose another logging.run_name.")
    if cfg.checkpoint.resume == "never" and not overwrite and RUN_ID_ENV not in os.environ:
        refuse_if_taken(cfg.run_dir)
    elif cfg.checkpoint.resume == "auto" and not overwrite:
        if (latest := latest_checkpoint(cfg.run_dir / "checkpoints")) is not None:
            check_base_of(latest, cfg.model.pretrained)  # LoRA adapters alone: the base they were trained on
            read_trainer_state(latest)  # what the resume reads first, checked before launch
            _check_checkpoint(cfg, latest)


def _check_checkpoint(cfg: Config, latest: Path) -> None:
    """The checkpoint a resume would load, against this config's model (names and shapes, on the model
    built on meta) and against its own metadata (every shard there and whole), reading only metadata and
    file sizes."""
    import torch

    from tessera.checkpoint.load import check_complete, check_model_shapes
    from tessera.models.build import build_model

    if read_meta(latest).get("groups") is None:  # (groups' weights are per group: the group's job checks them)
        with torch.device("meta"):
            model = build_model(cfg, weights=False)
        check_model_shapes(latest, model)
    check_complete(latest)


def _check_shapes(cfg: Config, plans: list[Plan]) -> None:
    """Each plan's tp, sp, ep and pp against the model's shapes, on the model built once on meta (no memory),
    and only when some plan splits the model."""
    splitting = [p for p in plans if max(p.tp, p.sp, p.ep, p.pp, *(r.tp for r in p.replicas or ())) > 1]
    if not splitting:
        return
    import torch

    from tessera.models.build import build_model
    from tessera.models.fits import check_plan_fits

    with torch.device("meta"):
        model = build_model(cfg, weights=False)
    try:
        for plan in splitting:
            check_plan_fits(model, plan, cfg.data.seq_len)
    except PlanError as exc:
        raise ConfigError(f"plan: {exc}") from None


def _check_experts(cfg: Config, plan: Plan) -> None:
    experts, have = _experts_of(cfg.model)
    if plan.expert_shares is not None and experts and sum(plan.expert_shares) != experts:
        raise ConfigError(
            f"plan.expert_shares={list(plan.expert_shares)} sum to {sum(plan.expert_shares)}, but the model has "
            f"{have}: give shares that sum to {experts}."
        )
    if plan.ep > 1 and (not experts or (experts % plan.ep and plan.expert_shares is None)):
        raise ConfigError(
            f"plan.ep={plan.ep} splits each MoE layer's experts over {plan.ep} ranks, but the model has {have}: "
            "set model.moe (or use a Hugging Face MoE config) with a number of experts ep divides, or plan.ep: 1."
        )


def _experts_of(model: Any) -> tuple[int, str]:
    """The experts per MoE layer the model config asks for (0: dense), and how to name that in an error:
    ``model.moe`` for the reference Llama, ``num_local_experts`` / ``num_experts`` of a Hugging Face config."""
    if model.moe is not None:
        return model.moe.experts, f"model.moe.experts={model.moe.experts}"
    path = model.hf_config or model.pretrained
    if path is not None:
        file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError):
            config = {}  # an unreadable config is the model builder's to name
        for key in ("num_local_experts", "num_experts"):
            if config.get(key):
                return int(config[key]), f"{key}={config[key]} in {file}"
    return 0, "no experts (model.moe)"
