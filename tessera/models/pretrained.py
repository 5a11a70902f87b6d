"""Pretrained Hugging Face weights, from a local ``save_pretrained`` directory, into any layout.

The model is built from the directory's ``config.json`` with its parameters on the meta device (no
memory, no initialisation; buffers such as rotary frequencies are computed as usual). The runtime lays
it out (tensor parallel, pipeline stages, FSDP shards: :func:`tessera.runtime.parallelize.parallelize`),
gives the parameters this rank holds memory, and each rank reads only its slices of the safetensors
files (``torch.distributed.checkpoint``'s Hugging Face reader slices each tensor as it reads it).
Everything that can be wrong with the directory — no weights, an index naming a missing file, missing,
unexpected or mis-shaped tensors — is one error before any layout is built.

Example::

    model = empty_pretrained("llama_dir")         # parameters on meta, the weights' names recorded
    model, optimizer = booster.boost(model, torch.optim.AdamW(model.parameters()))  # loaded here
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tessera.checkpoint.readers import CheckpointError, read_meta
from tessera.inputs import InputError
from tessera.models.lora import base_name

INDEX = "model.safetensors.index.json"
ATTRIBUTE = "_tessera_pretrained"  # where the model keeps its source until the runtime loads it


@dataclass(frozen=True)
class Pretrained:
    """Where a model's weights come from: the directory and the name of each tensor in its files."""

    path: Path
    stored: dict[str, tuple[int, ...]]  # tensor name -> shape, as the files hold them
    aliases: dict[str, tuple[str, ...]]  # each parameter or buffer name -> every name it has (tied weights)

    def key(self, name: str) -> str | None:
        """The name the files hold ``name``'s values under (a tied weight is stored under one of its names;
        peft's names are read as the base model's), or None: not from the files (a LoRA adapter)."""
        name = base_name(name)
        return next((alias for alias in self.aliases.get(name, (name,)) if alias in self.stored), None)


def source_of(model: nn.Module) -> Pretrained | None:
    """The weights ``model`` waits for (built by :func:`empty_pretrained`), or None."""
    return getattr(model, ATTRIBUTE, None)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules created inside keep their parameters on the meta device (the values are loaded later);
    buffers stay real, so those computed at construction (rotary frequencies) keep their values."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` directory: the index's, or the one file."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"model.pretrained '{path}' is not a directory: give a folder written by save_pretrained.")
    index = path / INDEX
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"]
            files = sorted(set(names.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise InputError(f"'{index}' is not a safetensors index (a JSON object with a weight_map).") from None
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise InputError(
                f"'{index}' names {len(missing)} file(s) that are not in '{path}': {', '.join(missing[:5])}; "
                "copy the whole directory."
            )
        return [path / f for f in files]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        hint = " (PyTorch .bin weights: load and save_pretrained them once with transformers)" if any(
            path.glob("*.bin")
        ) else ""  # fmt: skip
        raise InputError(f"model.pretrained '{path}' holds no safetensors weights{hint}.")
    return found


def stored_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape, from the files' headers (nothing else is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as exc:  # safetensors' own error types: a truncated or foreign file
            raise InputError(f"'{file}' is not a readable safetensors file ({exc}).") from None
    return shapes


def fingerprint(path: str | Path) -> str:
    """A digest of a pretrained directory's weight files, read in milliseconds: names, sizes, headers (each
    tensor's name, dtype, shape and place) and a sample of the values (each file's first and last MiB). A
    checkpoint holding LoRA adapters alone records it, so a resume or an export refuses another base (other
    files, shapes, dtypes or values; a change confined to the middle of a large file goes unseen)."""
    import hashlib

    digest = hashlib.sha256()
    sample = 1 << 20
    for file in weight_files(path):
        size = file.stat().st_size
        with file.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f"{file.name}:{size}:".encode() + f.read(min(header, 100 << 20)) + f.read(sample))
            f.seek(max(size - sample, 0))
            digest.update(f.read(sample))
    return digest.hexdigest()[:16]


def base_record(pretrained: str) -> dict[str, str]:
    """What a checkpoint holding LoRA adapters alone records of their base, the ``pretrained`` directory."""
    return {"pretrained": pretrained, "fingerprint": fingerprint(pretrained)}


def check_base_of(checkpoint: Path, pretrained: str | None) -> None:
    """Refuse a checkpoint holding LoRA adapters alone unless ``pretrained`` is the base they were trained on."""
    meta = read_meta(checkpoint)
    if meta.get("frozen", True) is True:
        return
    recorded = meta.get("base")
    if not isinstance(recorded, dict):
        raise CheckpointError(f"'{checkpoint / 'meta.json'}' is corrupted: it leaves the base out and names none.")
    check_same_base(recorded, pretrained, checkpoint)


def check_same_base(recorded: dict, pretrained: str | None, checkpoint: Path) -> None:
    """Refuse to complete a checkpoint that holds LoRA adapters alone (``recorded``: its meta.json's
    ``base``) with a base other than the one it was trained on."""
    was = recorded.get("pretrained")
    if pretrained is None:
        raise InputError(
            f"checkpoint '{checkpoint}' holds LoRA adapters without their base, which was read from '{was}': set "
            f"model.pretrained: {was}."
        )
    if fingerprint(pretrained) != recorded.get("fingerprint"):
        raise InputError(
            f"checkpoint '{checkpoint}' holds LoRA adapters trained on the weights in '{was}', and model.pretrained "
            f"'{pretrained}' holds other weights (files, shapes or dtypes differ): use the base it was trained on."
        )


def empty_pretrained(path: str | Path) -> nn.Module:
    """``AutoModelForCausalLM`` from ``path``'s config.json with its parameters on meta, checked against
    the weights the directory holds; the runtime loads them once the model is laid out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    files = weight_files(path)
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise InputError(f"model.pretrained '{path}' has no config transformers can read: {reason}") from None
    with parameters_on_meta():
        # fp32 parameters whatever dtype the weights were saved in (config.json records it, and transformers
        # would build in it): the Plan's precision decides what computes in lower precision
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    aliases: dict[str, list[str]] = {}
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    for names in by_tensor.values():
        for name in names:
            aliases[name] = names
    source = Pretrained(path, stored_shapes(files), {n: tuple(a) for n, a in aliases.items()})
    check_names(model, source)
    setattr(model, ATTRIBUTE, source)
    return model


def _loaded_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds values for: every parameter (each name) and persistent buffer."""
    state = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict(keep_vars=True))
    state.update({n: b for n, b in model.named_buffers() if n in persistent})
    return state


def check_names(model: nn.Module, source: Pretrained) -> None:
    """One error listing every tensor the model needs that the files lack, holds in another shape, or
    holds beyond what the model has (patterns the model's class says to ignore aside)."""
    state = _loaded_state(model)
    missing, misshaped = [], []
    for name, tensor in state.items():
        stored = [a for a in source.aliases.get(name, (name,)) if a in source.stored]
        if not stored:
            missing.append(name)
        elif source.stored[stored[0]] != tuple(tensor.shape):
            misshaped.append(f"{stored[0]}: stored {list(source.stored[stored[0]])}, model {list(tensor.shape)}")
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    unexpected = [k for k in source.stored if k not in state and not any(p.search(k) for p in ignore)]
    missing = [n for n in missing if source.aliases.get(n, (n,))[0] == n]  # a tied weight once
    if missing or misshaped or unexpected:
        lines = [f"model.pretrained '{source.path}' does not fit the model its config.json describes:"]
        for label, names in (("missing", missing), ("mis-shaped", misshaped), ("unexpected", unexpected)):
            if names:
                shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                lines.append(f"  {label} ({len(names)}): {shown}")
        lines.append("Use the config.json saved with these weights.")
        raise InputError("\n".join(lines))


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Buffers to ``device`` while the parameters are still on meta (``Module.to`` would refuse them)."""
    for sub in module.modules():
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and not buffer.is_meta:
                sub._buffers[name] = buffer.to(device)


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Give the parameters ``module`` holds (whole, tensor-parallel or FSDP shards) memory on ``device``,
    uninitialised until :func:`load_into` fills them; buffers, and parameters that had values already
    (LoRA adapters), keep them."""
    tensors = [*module.named_buffers(), *module.named_parameters()]
    kept = {n: t.detach().to(device).clone() for n, t in tensors if not t.is_meta}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # each Parameter object kept: ties survive
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for name, tensor in [*module.named_buffers(), *module.named_parameters()]:
        if name in kept:
            tensor.copy_(kept[name])


def load_into(module: nn.Module, source: Pretrained) -> None:
    """Fill ``module``'s parameters and persistent buffers (its names are the whole model's: a pipeline
    stage keeps them) from the files, each rank reading only the slices it holds; dtypes converted."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    state = {}
    for name, tensor in _loaded_state(module).items():
        key = source.key(name)
        if key is not None and key not in state:  # a tied weight held under two names is loaded once
            state[key] = tensor.data if isinstance(tensor, nn.Parameter) else tensor
    load(state, storage_reader=HuggingFaceStorageReader(str(source.path)), no_dist=True)
