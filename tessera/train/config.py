"""The training config: a typed YAML schema with clear errors, and ``--set`` overrides.

Every section forbids unknown keys; a mistyped key is reported with the nearest
valid one. Nothing is written to disk before the config validates.

Example:
    >>> cfg = load_config("examples/demo.yaml", overrides=["optimizer.lr=3e-4", "plan.zero=3"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tessera.errors import PlanError, nearest


class ConfigError(ValueError):
    """The training config is invalid; the message names the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """``kind: llama`` is the reference model sized by the fields below; ``kind: hf_gpt2`` /
    ``hf_llama`` build a Hugging Face model from the same sizes; ``kind: hf_config`` builds
    ``AutoModelForCausalLM`` from a local Hugging Face ``config.json`` (``hf_config``), sizes ignored."""

    kind: Literal["llama", "hf_gpt2", "hf_llama", "hf_config"] = "llama"
    hf_config: str | None = None
    dim: int = Field(128, gt=0)
    n_layers: int = Field(4, gt=0)
    n_heads: int = Field(4, gt=0)
    n_kv_heads: int = Field(2, gt=0)
    ffn_dim: int = Field(384, gt=0)
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if (self.kind == "hf_config") != (self.hf_config is not None):
            raise ValueError("model.hf_config (a path to a Hugging Face config.json) goes with model.kind: hf_config")
        if self.hf_config is not None and not Path(self.hf_config).exists():
            raise ValueError(f"model.hf_config='{self.hf_config}' does not exist: give a config.json or its folder")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}")
        return self


class DataConfig(_Section):
    """Text files by path or glob; empty means the Python standard library's own source files."""

    paths: list[str] = Field(default_factory=list)
    seq_len: int = Field(128, gt=0)
    max_bytes: int = Field(4_000_000, gt=0, description="read at most this many bytes of text")


class OptimizerConfig(_Section):
    name: Literal["adamw", "sgd", "lamb", "lars"] = "adamw"
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = Field(0.9, ge=0, lt=1)
    trust_coefficient: float = Field(0.001, gt=0, description="LARS η")
    grad_clip: float | None = Field(1.0, gt=0)


class ScheduleConfig(_Section):
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class PlanConfig(_Section):
    """A preset with its arguments, or ``file:`` naming a saved Plan (YAML/JSON)."""

    preset: Literal["ddp", "zero"] = "zero"
    zero: int = Field(2, ge=0, le=3)
    tp: int = Field(1, gt=0, description="tensor-parallel degree (composes with dp under any ZeRO stage)")
    sp: int = Field(1, gt=0, description="sequence-parallel degree: Ulysses ranks, or tp for split_gather")
    sp_mode: Literal["all_to_all", "split_gather"] = "all_to_all"
    loss_parallel: bool = Field(False, description="with tp: cross-entropy on vocabulary shards, logits never gathered")
    pp: int = Field(1, gt=0, description="pipeline-parallel degree (stages run by torch's schedules)")
    microbatches: int = Field(1, gt=0, description="micro-batches per step: pipelined, or accumulated when pp=1")
    schedule: Literal[
        "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"
    ] = "1f1b"
    stages: list[tuple[int, int]] | None = Field(
        None, description="layer range [first, end) of each pipeline stage; uneven is fine (default: even split)"
    )
    offload: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    dp_shares: list[int] | None = None
    file: str | None = None


class TrainConfig(_Section):
    steps: int = Field(150, gt=0)
    stop_at: int | None = Field(
        None, gt=0, description="stop (and checkpoint) after this step; the schedule still spans `steps`"
    )
    global_batch_size: int = Field(16, gt=0)
    seed: int = 0
    log_every: int = Field(10, gt=0)
    sample_bytes: int = Field(120, ge=0, description="bytes of text to generate at the end (0: none)")
    timeout_s: float = Field(600.0, gt=0, description="a collective waiting longer than this fails the run")
    peak_tflops: float | dict[str, float] | None = Field(
        None,
        description="declared dense peak TFLOP/s for MFU: one number for every device, or a map from "
        "device type (torch's CUDA device name, or 'cpu') to its peak, for mixed clusters",
    )

    @model_validator(mode="after")
    def _peaks_positive(self) -> TrainConfig:
        peaks = self.peak_tflops
        values = peaks.values() if isinstance(peaks, dict) else [peaks] if peaks is not None else []
        if any(v <= 0 for v in values):
            raise ValueError(f"train.peak_tflops must be positive, got {peaks}")
        return self


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    keep: int = Field(2, gt=0)
    resume: Literal["auto", "never"] = "auto"


class LoggingConfig(_Section):
    run_name: str = Field("demo", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    out_dir: str = "runs"
    progress: bool = True
    tensorboard: bool = True


class Config(_Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    plan: PlanConfig = PlanConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.out_dir) / self.logging.run_name


# ----------------------------------------------------------------------------- loading
def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        keys.append(prefix + name)
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys.extend(_valid_keys(sub, prefix + name + "."))
    return keys


def _explain(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    valid = _valid_keys(Config)
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'{nearest(key, valid)}")
        elif err["type"] == "value_error":  # our own checks already name the key
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        elif key:
            lines.append(f"'{key}': {err['msg']} (got {err.get('input')!r})")
        else:
            lines.append(err["msg"])
    return ConfigError(f"{source} is invalid: " + "; ".join(lines) + ".")


def _set(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"--set {override!r} must look like section.key=value (e.g. optimizer.lr=3e-4).")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {override!r}: '{k}' is not a section.")
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None


def parse_config(data: Any, overrides: list[str] | None = None, source: str = "the config") -> Config:
    """Validate a config mapping (plus ``key=value`` overrides) into a :class:`Config`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source} must be a YAML mapping of sections (model:, data:, ...), got {type(data).__name__}."
        )
    for override in overrides or []:
        _set(data, override)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise _explain(exc, source) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read and validate a YAML config file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from None
    return parse_config(data, overrides, source=f"config '{path}'")


def plan_from_config(cfg: PlanConfig) -> Any:
    """The tessera.Plan the config asks for."""
    from tessera import Plan
    from tessera.plan import PipelineSpec

    try:
        if cfg.file:
            return Plan.load(cfg.file)
        shares = tuple(cfg.dp_shares) if cfg.dp_shares else None
        zero = 0 if cfg.preset == "ddp" else cfg.zero
        pipeline = PipelineSpec(
            stages=tuple(tuple(s) for s in cfg.stages) if cfg.stages else None,
            microbatches=cfg.microbatches,
            schedule=cfg.schedule,
        )
        return Plan(
            tp=cfg.tp,
            sp=cfg.sp,
            sp_mode=cfg.sp_mode,
            loss_parallel=cfg.loss_parallel,
            pp=cfg.pp,
            pipeline=pipeline,
            zero=zero,
            offload=cfg.offload,
            precision=cfg.precision,
            dp_shares=shares,
            recompute=cfg.recompute,
        )
    except PlanError as exc:
        raise ConfigError(f"plan: {exc}") from None
