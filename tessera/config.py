"""The training config: a typed YAML schema with clear errors, and ``--set`` overrides.

Every section forbids unknown keys; a mistyped key is reported with the nearest
valid one. Nothing is written to disk before the config validates.

Example:
    >>> cfg = load_config("examples/demo.yaml", overrides=["optimizer.lr=3e-4", "plan.zero=3"])
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from tessera.errors import PlanError, nearest
from tessera.inputs import InputError, load_yaml, load_yaml_file, shown
from tessera.plan import PipelineSpec, Plan


class ConfigError(ValueError):
    """The training config is invalid; the message names the key and the fix."""


def _list_to_tuple(value: Any) -> Any:
    """YAML has lists, not tuples: a list given for a pair is taken as the pair (strict mode would refuse it)."""
    return tuple(value) if isinstance(value, list) else value


Pair = Annotated[tuple[int, int], BeforeValidator(_list_to_tuple)]
FloatPair = Annotated[tuple[float, float], BeforeValidator(_list_to_tuple)]

# Sizes a config may ask for. They bound what a typo (an extra zero, 2**40) can make a rank try to
# allocate; the memory estimate before launch checks the product against this machine.
MAX_DIM = 1 << 16
MAX_LAYERS = 1024
MAX_SEQ = 1 << 20
MAX_BATCH = 1 << 24
MAX_STEPS = 1 << 40
MAX_SEED = (1 << 63) - 1  # torch.manual_seed takes a signed 64-bit seed
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a collective may wait a week at most (timedelta needs a finite number)


# The Plan's fields as the config's plan: section spells them: the pipeline's sit flat.
PIPELINE_KEYS = tuple(f.name for f in dataclasses.fields(PipelineSpec))
PLAN_KEYS = tuple(f.name for f in dataclasses.fields(Plan) if f.name != "pipeline") + PIPELINE_KEYS
DEFAULT_ZERO_STAGE = 2  # the config's plan when it names no stage: ZeRO-2 (the demo's)


class _Section(BaseModel):
    # strict: no bool for an int, no "5" for a number; allow_inf_nan: every float is finite.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class LoraSpec(_Section):
    """LoRA adapters through peft: rank ``r``, scale ``alpha``/``r``, on the layers named ``target_modules``."""

    r: int = Field(8, gt=0, le=4096)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "v_proj"], min_length=1)


class MoeSpec(_Section):
    """Experts in place of the reference Llama's feed-forward blocks (tessera.models.moe): ``experts`` SwiGLU
    experts, each token sent to its ``top_k`` best by softmax or sigmoid scores, every token kept."""

    experts: int = Field(8, ge=2, le=1 << 12)
    top_k: int = Field(2, ge=1, le=1 << 12)
    score: Literal["softmax", "sigmoid"] = "softmax"
    aux_loss_weight: float = Field(0.01, ge=0, description="the Switch load-balance loss' weight")
    bias_rate: float = Field(0.0, ge=0, description="loss-free balancing: the bias step per optimizer step")
    shared_expert: bool = False
    hidden: int | None = Field(None, gt=0, le=4 * MAX_DIM, description="each expert's hidden size (model.ffn_dim)")
    warn_share: float = Field(
        0.5, gt=0, le=1, description="warn when one expert takes more than this share of a layer's routed slots"
    )
    warn_steps: int = Field(20, gt=0, description="... at this many reported steps in a row")

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoeSpec:
        if self.top_k > self.experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} is more than model.moe.experts={self.experts}: a token cannot go "
                "to more experts than there are"
            )
        return self


class ModelConfig(_Section):
    """``kind: llama`` is the reference model sized by the fields below; ``kind: hf_gpt2`` /
    ``hf_llama`` build a Hugging Face model from the same sizes; ``kind: hf_config`` builds
    ``AutoModelForCausalLM`` from a local Hugging Face ``config.json`` (``hf_config``), sizes ignored;
    ``pretrained: DIR`` (kind ``hf_pretrained``, set by it) loads a local ``save_pretrained`` directory's
    weights into whatever layout the plan gives, each rank reading only the slices it holds."""

    kind: Literal["llama", "hf_gpt2", "hf_llama", "hf_config", "hf_pretrained"] = "llama"
    hf_config: str | None = None
    pretrained: str | None = None
    lora: LoraSpec | None = None
    moe: MoeSpec | None = None
    dim: int = Field(128, gt=0, le=MAX_DIM)
    n_layers: int = Field(4, gt=0, le=MAX_LAYERS)
    n_heads: int = Field(4, gt=0, le=MAX_DIM)
    n_kv_heads: int = Field(2, gt=0, le=MAX_DIM)
    ffn_dim: int = Field(384, gt=0, le=4 * MAX_DIM)
    tie_embeddings: bool = False

    @model_validator(mode="before")
    @classmethod
    def _pretrained_kind(cls, data: Any) -> Any:
        """``pretrained: DIR`` alone means ``kind: hf_pretrained``."""
        if isinstance(data, dict) and data.get("pretrained") is not None and "kind" not in data:
            return {**data, "kind": "hf_pretrained"}
        return data

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.pretrained is not None:
            if self.kind != "hf_pretrained":
                raise ValueError(
                    f"model.pretrained takes the architecture from {shown(self.pretrained)}'s config.json: drop "
                    f"model.kind={shown(self.kind)}"
                )
            if not (Path(self.pretrained) / "config.json").is_file():
                raise ValueError(
                    f"model.pretrained={shown(self.pretrained)} is not a save_pretrained directory (no config.json "
                    "in it): give the folder holding config.json and the safetensors weights"
                )
        elif self.kind == "hf_pretrained":
            raise ValueError("model.kind: hf_pretrained needs model.pretrained (a save_pretrained directory)")
        if (self.kind == "hf_config") != (self.hf_config is not None):
            raise ValueError("model.hf_config (a path to a Hugging Face config.json) goes with model.kind: hf_config")
        if self.hf_config is not None and not Path(self.hf_config).exists():
            raise ValueError(
                f"model.hf_config={shown(self.hf_config)} does not exist: give a config.json or its folder"
            )
        if self.moe is not None and self.kind != "llama":
            raise ValueError(
                f"model.moe makes the reference Llama's feed-forward blocks experts: use model.kind: llama (got "
                f"{shown(self.kind)})"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must be divisible by model.n_kv_heads={self.n_kv_heads}")
        return self


def _dataset_shorthand(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value


class DatasetSource(_Section):
    """``data.dataset``: rows the ``datasets`` library reads (:mod:`tessera.data.hf_dataset`). ``path``: a
    ``save_to_disk`` folder, or what ``load_dataset`` takes (a builder such as ``json``, ``csv``, ``parquet``
    or ``text`` with ``data_files``; a folder of data files; a Hub name, where the Hub is reachable). A plain
    string is the path."""

    path: str = Field(min_length=1)
    name: str | None = Field(None, description="the dataset's configuration (load_dataset's name)")
    data_files: list[str] | None = Field(None, description="files for a builder such as json or csv")
    split: str = Field("train", min_length=1)
    text_field: str = Field("text", min_length=1, description="the text column, when rows are plain text")


class DataConfig(_Section):
    """Text files by path or glob; empty means the Python standard library's own source files. Or
    ``prepared`` token shards, ``instructions`` jsonl files, or a ``dataset`` read by the datasets library."""

    paths: list[str] = Field(default_factory=list)
    seq_len: int = Field(128, gt=0, le=MAX_SEQ)
    max_bytes: int = Field(4_000_000, gt=0, le=1 << 34, description="read at most this many bytes of text")
    tokenizer: str | None = Field(
        None,
        description="bytes, or a tokenizer.json (or its directory); unset: data.prepared's, model.pretrained's "
        "own, else bytes",
    )
    prepared: str | None = Field(None, description="a folder `tessera data prepare` wrote: train from its shards")
    instructions: list[str] = Field(
        default_factory=list,
        description="jsonl files of prompt/response or messages records: fine-tune on the responses only",
    )
    pack: bool = Field(
        False, description="instructions: as many whole records per sequence as fit, kept apart by the attention mask"
    )
    validation: float = Field(
        0.0, ge=0, lt=0.5, description="the share of the data's sequences held out for eval (the last ones)"
    )
    on_bad_record: Literal["stop", "skip"] = "stop"
    dataset: Annotated[DatasetSource | None, BeforeValidator(_dataset_shorthand)] = Field(
        None,
        description="rows through the datasets library: text (text_field), or prompt/response or messages records "
        "to fine-tune on",
    )

    @model_validator(mode="after")
    def _tokenizer_exists(self) -> DataConfig:
        if self.tokenizer not in (None, "bytes") and not Path(self.tokenizer).exists():
            raise ValueError(
                f"data.tokenizer={shown(self.tokenizer)} does not exist: give a tokenizer.json, the directory "
                "holding it, or bytes"
            )
        if self.pack and not (self.instructions or self.dataset):
            raise ValueError("data.pack packs data.instructions records: set data.instructions, or data.pack: false")
        if self.dataset is not None and (self.paths or self.prepared or self.instructions):
            raise ValueError(
                "data.dataset is the training data: leave data.paths, data.prepared and data.instructions unset"
            )
        if self.instructions and (self.paths or self.prepared):
            raise ValueError("data.instructions is the training data: leave data.paths and data.prepared unset")
        if self.prepared is not None:
            if self.paths:
                raise ValueError("data.prepared trains from prepared shards: leave data.paths empty")
            if not (Path(self.prepared) / "index.json").is_file():
                raise ValueError(
                    f"data.prepared={shown(self.prepared)} holds no index.json: prepare it with `tessera data "
                    "prepare ... --out FOLDER` (an interrupted preparation resumes when run again)"
                )
        return self


class OptimizerConfig(_Section):
    name: Literal["adamw", "sgd", "lamb", "lars"] = "adamw"
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: FloatPair = (0.9, 0.95)
    momentum: float = Field(0.9, ge=0, lt=1)
    trust_coefficient: float = Field(0.001, gt=0, description="LARS η")
    grad_clip: float | None = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _betas_in_range(self) -> OptimizerConfig:
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas={list(self.betas)}: each must be in [0, 1), e.g. [0.9, 0.95]")
        return self


class ScheduleConfig(_Section):
    kind: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class PlanConfig(_Section):
    """A preset (``ddp``, or ``zero`` with ``zero:`` its stage) or ``file:`` naming a saved Plan.
    Every other key is a field of :class:`tessera.Plan`, the pipeline's flat (``microbatches``,
    ``schedule``, ``stages``), and the Plan itself checks them: there is one schema, so a field
    added to the Plan is accepted here as it is."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True, allow_inf_nan=False)

    preset: Literal["ddp", "zero"] = "zero"
    file: str | None = None
    _plan: Plan | None = PrivateAttr(default=None)  # built once: at load time, or a plan file when first asked
    _planned_world: int | None = PrivateAttr(default=None)  # the world size a plan file records, once read

    @model_validator(mode="after")
    def _plan_fields(self) -> PlanConfig:
        extra = self.model_extra or {}
        for key in extra:
            if key not in PLAN_KEYS:
                raise ValueError(f"unknown key 'plan.{key}'{nearest(key, ('preset', 'file', *PLAN_KEYS))}")
        if self.file is None:
            self._plan = _build_plan(self)  # the Plan's own checks, at load time
        return self

    def plan_fields(self) -> dict[str, Any]:
        """The Plan fields this section sets (the preset's ZeRO stage filled in)."""
        fields = dict(self.model_extra or {})
        if self.preset == "ddp" and fields.get("zero", 0) != 0:
            raise ConfigError(
                f"plan.zero={shown(fields['zero'])} with plan.preset: ddp (which is ZeRO-0): "
                "use preset: zero for a ZeRO stage."
            )
        fields["zero"] = 0 if self.preset == "ddp" else fields.get("zero", DEFAULT_ZERO_STAGE)
        return fields


class TrainConfig(_Section):
    steps: int = Field(150, gt=0, le=MAX_STEPS)
    stop_at: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="stop (and checkpoint) after this step; the schedule still spans `steps`"
    )
    global_batch_size: int = Field(16, gt=0, le=MAX_BATCH)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    log_every: int = Field(10, gt=0)
    sample_bytes: int = Field(120, ge=0, le=1 << 20, description="bytes of text to generate at the end (0: none)")
    timeout_s: float = Field(
        600.0, gt=0, le=MAX_TIMEOUT_S, description="a collective waiting longer than this fails the run"
    )
    measure_memory_at: int = Field(
        0,
        ge=0,
        le=MAX_STEPS,
        description="measure this step's peak tensor bytes on every rank (allocator-level; a one-step profiler "
        "pass on CPU) and log them as peak_tensor_bytes_per_rank; 0: never",
    )
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
    """``base``: with LoRA adapters (``model.lora``), whether checkpoints hold the frozen base weights too.
    By default they do unless the base is read from ``model.pretrained`` (then the adapters and their
    optimizer state alone are saved, and a resume or an export reads the base from that directory again)."""

    every: int = Field(0, ge=0, description="save every N steps (0: only at the end)")
    keep: int = Field(2, gt=0, le=1 << 20)
    resume: Literal["auto", "never"] = "auto"
    base: bool | None = None


class EvalConfig(_Section):
    """Held-out loss and perplexity every ``every`` steps (and at the end) on the first ``batches`` global
    batches of ``data.validation``'s sequences."""

    every: int = Field(0, ge=0, le=MAX_STEPS, description="evaluate every N steps (0: never)")
    batches: int = Field(4, gt=0, le=1 << 20, description="global batches of held-out sequences per evaluation")


class LoggingConfig(_Section):
    """Where a run writes, and the trackers it mirrors ``metrics.jsonl`` to (:mod:`tessera.train.trackers`):
    ``trackers: [tensorboard, wandb, mlflow]`` names them; left out, TensorBoard is used when installed
    (``tensorboard: false`` turns that off). ``project`` is the W&B project and the MLflow experiment."""

    run_name: str = Field("demo", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    out_dir: str = "runs"
    progress: bool = True
    tensorboard: bool = True
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None, description="experiment trackers (default: tensorboard, when installed)"
    )
    project: str = Field("tessera", min_length=1, description="W&B project / MLflow experiment")

    @model_validator(mode="after")
    def _one_say_on_tensorboard(self) -> LoggingConfig:
        if self.trackers is not None:
            if len(set(self.trackers)) < len(self.trackers):
                raise ValueError(f"logging.trackers={self.trackers} names a tracker twice: list each once")
            if not self.tensorboard and "tensorboard" in self.trackers:
                raise ValueError(
                    "logging.tensorboard: false, but logging.trackers lists tensorboard: drop one of them "
                    "(with trackers given, tensorboard: is not needed)"
                )
        return self


class Config(_Section):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    plan: PlanConfig = Field(default_factory=PlanConfig)
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _base_left_out_only_when_read_again(self) -> Config:
        if self.checkpoint.base is False and (self.model.lora is None or self.model.pretrained is None):
            raise ValueError(
                "checkpoint.base: false leaves the frozen base weights out of checkpoints, which needs LoRA "
                "adapters (model.lora) on a base read from model.pretrained (so a resume can read it again): "
                "set both, or drop checkpoint.base"
            )
        return self

    @property
    def checkpoint_holds_base(self) -> bool:
        """Whether checkpoints hold the frozen base weights (``checkpoint.base``, resolved)."""
        if self.checkpoint.base is not None:
            return self.checkpoint.base
        return self.model.lora is None or self.model.pretrained is None

    @model_validator(mode="after")
    def _held_out_for_eval(self) -> Config:
        if self.eval.every and not self.data.validation:
            raise ValueError(
                f"eval.every={self.eval.every} evaluates on held-out sequences: set data.validation (e.g. 0.05, "
                "the share of the data held out)"
            )
        return self

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
            lines.append(str(err["msg"]).removeprefix("Value error, ").rstrip("."))
        elif key:
            lines.append(f"'{key}': {err['msg']} (got {shown(err.get('input'))})")
        else:
            lines.append(err["msg"])
    return ConfigError(f"{source} is invalid: " + "; ".join(lines) + ".")


def _set(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"--set {override!r} must look like section.key=value (e.g. optimizer.lr=3e-4).")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError(f"--set {shown(override)}: '{path}' is not a key like section.key (e.g. optimizer.lr).")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {shown(override)}: '{k}' is not a section.")
    try:
        node[keys[-1]] = load_yaml(raw, f"--set {path}=...") if raw.strip() else None
    except InputError as exc:
        raise ConfigError(str(exc)) from None


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
    try:
        data = load_yaml_file(path, "config file")
    except InputError as exc:
        raise ConfigError(str(exc)) from None
    return parse_config(data, overrides, source=f"config '{path}'")


def plan_from_config(cfg: PlanConfig) -> Plan:
    """The tessera.Plan the config's ``plan:`` section asks for (built once per config)."""
    if cfg._plan is None:  # a plan file: read when first asked (a stored config's file may be gone)
        cfg._plan = _build_plan(cfg)
    return cfg._plan


def planned_world_size(cfg: PlanConfig) -> int | None:
    """The ranks the config's plan file says it was made for (None: no file, or one that does not say)."""
    plan_from_config(cfg)  # reads the file, once
    return cfg._planned_world


def _build_plan(cfg: PlanConfig) -> Plan:
    if cfg.file:
        try:
            plan, cfg._planned_world = Plan.load_file(cfg.file)
        except PlanError as exc:
            raise ConfigError(f"plan: {exc}") from None
        return plan
    fields = cfg.plan_fields()
    pipeline = {k: fields.pop(k) for k in PIPELINE_KEYS if k in fields}
    try:
        return Plan.from_dict({**fields, "pipeline": pipeline})
    except PlanError as exc:  # name the config's keys, not the Plan's nesting
        raise ConfigError(str(exc).replace("Plan.pipeline.", "plan.").replace("Plan.", "plan.")) from None
