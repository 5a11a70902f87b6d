"""Export a checkpoint's full model: safetensors for any model, ``save_pretrained`` for Hugging Face ones.

Runs in one plain process (no process group), whatever layout wrote the checkpoint.

    tessera export runs/demo/checkpoints/step_00000400 --out model.safetensors [--hf-dir hf_model/]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tessera.checkpoint.readers import (
    CheckpointError,
    DataOnlyFullLoadPlanner,
    DataOnlyReader,
    read_meta,
    refusal_inside,
)
from tessera.inputs import InputError, check_output_dir, check_output_file


def check_export_targets(
    checkpoint: str | Path, out: str | None, hf_dir: str | None, force: bool, adapter_dir: str | None = None
) -> None:
    """Refuse before reading anything: a target inside the checkpoint (never, even with ``force``), an
    existing file or non-empty directory (without ``force``), a path that is a directory, under a file,
    or not writable."""
    source = Path(checkpoint).resolve()
    read_meta(checkpoint_root(source))
    for target, flag in ((out, "--out"), (hf_dir, "--hf-dir"), (adapter_dir, "--adapter-dir")):
        if target is None:
            continue
        resolved = Path(target).resolve()
        if resolved == source or source in resolved.parents:
            raise InputError(
                f"{flag} '{target}' lies inside the checkpoint being exported ('{checkpoint}'): write it elsewhere; "
                "a checkpoint is never modified."
            )
    if out is not None:
        check_output_file(out, "--out", force)
    for target, flag in ((hf_dir, "--hf-dir"), (adapter_dir, "--adapter-dir")):
        if target is None:
            continue
        path = check_output_dir(target, flag)
        if path.is_dir() and any(path.iterdir()) and not force:
            raise InputError(
                f"{flag} '{target}' exists and is not empty: choose another directory, or pass --force to write "
                "over its files."
            )


def checkpoint_root(path: str | Path) -> Path:
    """The checkpoint ``path`` is, or holds as one group's folder (``step_N/group_<g>``)."""
    path = Path(path)
    return path.parent if path.name.startswith("group_") and (path.parent / "meta.json").is_file() else path


def model_folders(path: str | Path) -> list[tuple[str, Path]]:
    """Each model a checkpoint holds, named, with the folder of its DCP state: the checkpoint itself, or
    one folder per group under Plan.groups with an outer sync (``group_<g>``; a fault-tolerant group's
    checkpoint holds its own only)."""
    path = Path(path)
    meta = read_meta(path)
    groups = meta.get("groups")
    if groups is None:
        return [(path.name, path)]
    holds = meta.get("holds", list(range(groups)))  # a fault-tolerant group's job writes its own folder only
    if not isinstance(holds, list) or not holds or not all(isinstance(g, int) and 0 <= g < groups for g in holds):
        raise CheckpointError(f"'{path / 'meta.json'}' is corrupted: holds={holds!r} is not a list of its groups.")
    return [(f"{path.name}/group_{g}", path / f"group_{g}") for g in holds]


def load_full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model parameters of a Tessera checkpoint (or of one group's folder in it), on
    the CPU."""
    path = Path(path)
    folders = model_folders(path) if checkpoint_root(path) == path else [(path.name, path)]
    if len(folders) > 1:
        raise CheckpointError(
            f"checkpoint '{path}' holds {len(folders)} groups' models (Plan.groups): export one group's folder "
            f"('{path}/group_0') or their average (`tessera merge {path} --out model.safetensors`)."
        )
    path = folders[0][1]
    DataOnlyReader(str(path)).read_metadata()  # checked here first: DCP would fold a refusal into its own error
    state: dict = {}
    try:
        # dcp.load() only fills keys the caller already has; the loader beneath it (what torch's own
        # dcp_to_torch_save uses) lets the planner build the state from the checkpoint's metadata.
        _load_state_dict(
            state,
            storage_reader=DataOnlyReader(str(path)),
            planner=DataOnlyFullLoadPlanner(keys={"model"}),
            no_dist=True,
        )
    except (Exception, CheckpointException) as exc:
        if (refused := refusal_inside(exc)) is not None:
            raise refused from None
        raise CheckpointError(f"checkpoint '{path}' could not be read ({type(exc).__name__}).") from None
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def export_safetensors(path: str | Path, out: str | Path) -> Path:
    """Write the checkpoint's model to one ``.safetensors`` file (tied weights stored once each name); a
    LoRA run's with its adapters folded in (the names its base model has)."""
    from safetensors.torch import save_file

    cfg = stored_config(path, required=False)
    if cfg is not None and cfg.model.lora is not None:
        from tessera.models.lora import merged

        state = merged(_trained_model(path, cfg)).state_dict()
    else:
        state = load_full_model_state(path)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"format": "pt", "source": str(path)})
    return out


def stored_config(path: str | Path, required: bool = True) -> Any:
    """The training config a checkpoint records (None where it records none and ``required`` is False)."""
    from tessera.config import parse_config

    meta = read_meta(checkpoint_root(path))
    if "config" not in meta:
        if not required:
            return None
        raise CheckpointError(f"checkpoint '{path}' records no training config: cannot tell which model it holds.")
    return parse_config(meta["config"], source=f"the config stored in '{path}'")


def tokenizer_source_of(cfg: Any) -> Path | None:
    """Where the tokenizer a run trained with lies (its directory, or its tokenizer.json), None for bytes:
    ``data.tokenizer``, else the prepared data's own, else the pretrained model's."""
    from tessera.data.shards import read_index
    from tessera.data.tokenizer import is_tokenizer_dir

    if cfg.data.tokenizer is not None:
        return None if cfg.data.tokenizer == "bytes" else Path(cfg.data.tokenizer)
    if cfg.data.prepared is not None:
        kept = read_index(cfg.data.prepared)["tokenizer"]
        return None if kept == "bytes" else Path(cfg.data.prepared) / kept
    pretrained = cfg.model.pretrained
    return Path(pretrained) if pretrained is not None and is_tokenizer_dir(Path(pretrained)) else None


def _adapters_on_their_base(path: str | Path, cfg: Any) -> torch.nn.Module:
    """The model of a checkpoint that holds LoRA adapters alone: the base read from ``model.pretrained``
    (checked to be the one they were trained on), the adapters from the checkpoint."""
    from tessera.models.build import build_model
    from tessera.models.pretrained import check_base_of, load_into, materialize, source_of

    check_base_of(checkpoint_root(path), cfg.model.pretrained)
    model = build_model(cfg)  # the base on meta, then read from its files
    materialize(model, torch.device("cpu"))
    load_into(model, source_of(model))
    adapters = load_full_model_state(path)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if unexpected or set(missing) - frozen:
        raise CheckpointError(
            f"checkpoint '{path}' does not hold this config's adapters: {len(set(missing) - frozen)} missing, "
            f"{len(unexpected)} unexpected (e.g. {sorted(set(missing) - frozen or set(unexpected))[:3]})."
        )
    return model


def _trained_model(path: str | Path, cfg: Any) -> torch.nn.Module:
    """The model a checkpoint holds, whole: its weights, or a LoRA run's adapters on their base."""
    from tessera.models.build import build_model

    if read_meta(checkpoint_root(path)).get("frozen", True) is not True:
        return _adapters_on_their_base(path, cfg)
    model = build_model(cfg, weights=False)  # the checkpoint's weights go into it
    model.load_state_dict(load_full_model_state(path), strict=True)
    return model


def export_hf(path: str | Path, out_dir: str | Path) -> Path:
    """Rebuild the Hugging Face model named in the checkpoint's config and ``save_pretrained`` it, LoRA
    adapters folded in, with every file of the tokenizer it trained with."""
    from tessera.data.tokenizer import copy_tokenizer
    from tessera.models.lora import merged

    cfg = stored_config(path)
    if not cfg.model.kind.startswith("hf_"):
        raise CheckpointError(
            f"--hf-dir needs a Hugging Face model, but this checkpoint holds model.kind='{cfg.model.kind}': "
            "export it with --out model.safetensors instead."
        )
    merged(_trained_model(path, cfg)).save_pretrained(str(out_dir))
    if (tokenizer := tokenizer_source_of(cfg)) is not None:  # a complete directory: the tokenizer beside the weights
        copy_tokenizer(tokenizer, Path(out_dir))
    return Path(out_dir)


def export_adapter(path: str | Path, out_dir: str | Path) -> Path:
    """A LoRA run's adapters as a PEFT adapter folder, written by peft's own ``save_pretrained``
    (``adapter_config.json`` + ``adapter_model.safetensors``): ``PeftModel.from_pretrained(base, out_dir)``
    puts them on the base model. The base is not read (it stays on meta): the adapters alone are written.

    Example::

        export_adapter("runs/finetune/checkpoints/step_00000300", "adapter/")
    """
    from tessera.models.build import build_model
    from tessera.models.lora import is_adapter

    cfg = stored_config(path)
    if cfg.model.lora is None:
        raise CheckpointError(
            f"--adapter-dir needs a LoRA run, but the config stored in '{path}' has no model.lora: export the full "
            "model with --out or --hf-dir."
        )
    model = build_model(cfg)  # a pretrained base stays on meta; the adapters are real
    adapters = {k: v for k, v in load_full_model_state(path).items() if is_adapter(k)}
    expected = {n for n, _ in model.named_parameters() if is_adapter(n)}
    if adapters.keys() != expected:
        raise CheckpointError(
            f"checkpoint '{path}' does not hold this config's adapters: {len(expected - adapters.keys())} missing, "
            f"{len(adapters.keys() - expected)} unexpected."
        )
    model.load_state_dict(adapters, strict=False)
    if cfg.model.pretrained is not None:  # where PeftModel.from_pretrained's users find the base
        model.peft_config["default"].base_model_name_or_path = str(Path(cfg.model.pretrained).resolve())
    model.save_pretrained(str(out_dir))
    return Path(out_dir)
