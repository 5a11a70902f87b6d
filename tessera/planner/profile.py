"""The profiler: what one layer of a model costs on this device, and what this process group's links do.

Per part of the model — the first stage's embeddings, one transformer block, the last stage's
norm and head — it measures forward time, backward time and the bytes saved for backward, for a
few micro-batch sizes, by running that part alone as a pipeline stage (the policy's own stage
code, so the numbers are the ones a stage will see). Parameters are counted, not timed.
:func:`measure_links` times all-reduce and point-to-point transfers of the current group.

Profiles are cached as JSON by (model, device type). A device type that cannot be profiled
here gets :func:`scale_profile`: times multiplied by the ratio of datasheet peaks, and the
profile records that it was scaled and from what.

Example:
    >>> prof = profile_model(model, batch_sizes=(1, 2), seq_len=128)
    >>> prof.layers["block"].forward_s[2]      # seconds for one block, micro-batch 2
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.cluster.catalog import DeviceType
from tessera.cluster.detect import median_seconds
from tessera.memory import SavedBytes


@dataclass
class LayerProfile:
    """One part of the model; dicts are keyed by micro-batch size."""

    forward_s: dict[int, float] = field(default_factory=dict)
    backward_s: dict[int, float] = field(default_factory=dict)
    activation_bytes: dict[int, int] = field(default_factory=dict)
    param_bytes: int = 0
    param_tensors: int = 0  # parameter tensors: ZeRO-1 broadcasts each one after every step


@dataclass
class Profile:
    """Per-part costs of a model on one device type, at one sequence length."""

    model_key: str
    device_type: str
    seq_len: int
    n_layers: int
    layers: dict[str, LayerProfile]  # "first", "block", "last"
    scaled_from: str | None = None  # set when the times were scaled from another device type's

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        data = json.loads(text)
        layers = {
            name: LayerProfile(
                {int(k): v for k, v in lp["forward_s"].items()},
                {int(k): v for k, v in lp["backward_s"].items()},
                {int(k): v for k, v in lp["activation_bytes"].items()},
                lp["param_bytes"],
                lp.get("param_tensors", 0),  # profiles cached before it was recorded
            )
            for name, lp in data.pop("layers").items()
        }
        return cls(layers=layers, **data)


def model_key(model: nn.Module) -> str:
    """A short stable key for a model's architecture: class name plus a hash of its config."""
    config = getattr(model, "config", None)
    text = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
    return f"{type(model).__name__}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _profile_part(
    part: nn.Module,
    make_input: Callable[[int], torch.Tensor],
    batch_sizes: tuple[int, ...],
    repeats: int,
    min_window_s: float = 0.0,
) -> LayerProfile:
    prof = LayerProfile(
        param_bytes=sum(p.numel() * p.element_size() for p in part.parameters()),
        param_tensors=len(list(part.parameters())),
    )
    for b in batch_sizes:
        x = make_input(b)
        prof.forward_s[b] = median_seconds(lambda x=x: part(x), repeats, min_window_s)
        counter = SavedBytes(exclude=[*part.parameters(), *part.buffers()])
        with counter.track():
            out = part(x)
        prof.activation_bytes[b] = counter.peak
        grad = torch.ones_like(out)

        def backward(x: torch.Tensor = x, grad: torch.Tensor = grad) -> None:
            out = part(x)
            out.backward(grad)

        # Backward alone: (forward + backward) minus forward.
        prof.backward_s[b] = max(median_seconds(backward, repeats, min_window_s) - prof.forward_s[b], 0.0)
        part.zero_grad(set_to_none=True)
    return prof


def profile_model(
    model: nn.Module,
    batch_sizes: tuple[int, ...] = (1, 2, 4),
    seq_len: int = 128,
    device: torch.device | None = None,
    device_type: str = "cpu",
    repeats: int = 3,
    min_window_s: float = 0.0,
) -> Profile:
    """Time the first part, one block and the last part of ``model`` on ``device`` (each timing a window
    of at least ``min_window_s`` seconds of calls, see :func:`~tessera.cluster.detect.median_seconds`)."""
    from tessera.models.policies import policy_for
    from tessera.parallel.pipeline import StageModule

    device = device or torch.device("cpu")
    layout = policy_for(model, "the profiler").pipeline_layout(model)
    n_layers = len(model.get_submodule(layout.layers))
    first = StageModule(model, layout, 0, 0, is_first=True, is_last=False).to(device)
    block = StageModule(model, layout, 0, 1, is_first=False, is_last=False).to(device)
    last = StageModule(model, layout, n_layers, n_layers, is_first=False, is_last=True).to(device)
    vocab = model.config.vocab_size
    with torch.no_grad():
        hidden = first(torch.zeros(1, seq_len, dtype=torch.long, device=device)).shape[-1]

    def tokens(b: int) -> torch.Tensor:
        return torch.randint(0, vocab, (b, seq_len), device=device)

    def states(b: int) -> torch.Tensor:
        return torch.randn(b, seq_len, hidden, device=device, requires_grad=True)

    layers = {
        "first": _profile_part(first, tokens, batch_sizes, repeats, min_window_s),
        "block": _profile_part(block, states, batch_sizes, repeats, min_window_s),
        "last": _profile_part(last, states, batch_sizes, repeats, min_window_s),
    }
    return Profile(model_key(model), device_type, seq_len, n_layers, layers)


def scale_profile(profile: Profile, source: DeviceType, target: DeviceType, dtype: str = "fp32") -> Profile:
    """``profile`` as ``target`` would run it: times × peak(source) / peak(target)."""
    src, dst = source.peak(dtype), target.peak(dtype)
    if src is None or dst is None:
        missing = source.name if src is None else target.name
        raise ValueError(f"cannot scale a profile by {dtype} peaks: {missing} has no {dtype} figure")
    ratio = src / dst
    layers = {
        name: LayerProfile(
            {b: t * ratio for b, t in lp.forward_s.items()},
            {b: t * ratio for b, t in lp.backward_s.items()},
            dict(lp.activation_bytes),
            lp.param_bytes,
            lp.param_tensors,
        )
        for name, lp in profile.layers.items()
    }
    return Profile(profile.model_key, target.name, profile.seq_len, profile.n_layers, layers, scaled_from=source.name)


def cached_profile(cache_dir: str | Path, model: nn.Module, device_type: str, **kwargs: Any) -> Profile:
    """The cached profile of (model, device type, sequence length), profiling it on a miss."""
    seq_len = kwargs.get("seq_len", 128)
    path = Path(cache_dir) / f"{model_key(model)}-{device_type}-s{seq_len}.json"
    if path.is_file():
        return Profile.from_json(path.read_text())
    profile = profile_model(model, device_type=device_type, **kwargs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.to_json())
    return profile


def measure_links(
    group: dist.ProcessGroup | None = None, sizes: tuple[int, ...] = (1 << 16, 1 << 22), repeats: int = 3
) -> dict[str, dict[int, float]]:
    """Achieved all-reduce and point-to-point bandwidth (GB/s) of ``group`` per message size in bytes,
    and the microseconds each one-number broadcast of a burst takes (``latency_us``, keyed by its 4 bytes).

    All-reduce bandwidth is the bus bandwidth convention: 2(n-1)/n × bytes / time. Point to
    point is ranks 0 → 1 of the group. Every rank of the group must call this.
    """
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )
    out: dict[str, dict[int, float]] = {"all_reduce": {}, "p2p": {}, "latency_us": {}}
    # What each of many small collectives costs (ZeRO-1 issues one per parameter piece): a burst of
    # 16 one-number broadcasts from rank 0, launched together like those, per broadcast.
    tiny = [torch.ones(1, device=device) for _ in range(16)]
    root = dist.get_global_rank(group, 0)

    def burst() -> None:
        for work in [dist.broadcast(t, root, group=group, async_op=True) for t in tiny]:
            work.wait()

    out["latency_us"][4] = median_seconds(burst, repeats) / len(tiny) * 1e6
    for size in sizes:
        t = torch.ones(size // 4, device=device)
        seconds = median_seconds(lambda t=t: dist.all_reduce(t, group=group), repeats)
        out["all_reduce"][size] = 2 * (world - 1) / world * size / seconds / 1e9
        if world > 1:
            peer = dist.get_global_rank(group, 1 - rank) if rank < 2 else -1

            def p2p(t: torch.Tensor = t, peer: int = peer) -> None:
                if rank == 0:
                    dist.send(t, peer)
                elif rank == 1:
                    dist.recv(t, peer)
                dist.barrier(group=group)

            out["p2p"][size] = size / median_seconds(p2p, repeats) / 1e9
    return out
