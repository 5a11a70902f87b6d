"""Merge islands: the models of groups that trained apart (``Plan.groups``, ``sync: none``, or any
checkpoints of one model), averaged or ensembled, each judged on held-out text.

    tessera merge runs/a/checkpoints/step_00000400 [more checkpoints] [--out merged.safetensors]

Every model a checkpoint holds is an island: one per group folder under Plan.groups, else the
checkpoint's own. The held-out text is what follows the bytes the run trained on: the same files
(from the config stored in the first checkpoint), from ``data.max_bytes`` on. The report gives
each island's loss on it, the loss of the parameter average and of the uniform ensemble (the mean
of the islands' predicted probabilities). ``--out`` writes the average as safetensors.
Runs in one plain process (no process group), whatever layout wrote the checkpoints.

Example:
    >>> report = merge(["runs/a/checkpoints/step_00000400"], eval_bytes=131072)
    >>> report.losses["average"]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tessera.checkpoint.readers import CheckpointError, read_meta
from tessera.data.text import PackedText, resolve_paths
from tessera.export import load_full_model_state, model_folders

EVAL_BATCH = 16


@dataclass
class MergeReport:
    """Held-out loss of each island and of the two merges, and how many tokens judged them."""

    losses: dict[str, float] = field(default_factory=dict)  # island name, "average", "ensemble"
    tokens: int = 0

    def table(self) -> str:
        width = max(len(name) for name in self.losses)
        lines = [f"{'model':<{width}}  held-out loss ({self.tokens:,} tokens)"]
        lines += [f"{name:<{width}}  {loss:.4f}" for name, loss in self.losses.items()]
        return "\n".join(lines)


def islands(checkpoints: list[str | Path]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Every model the checkpoints hold, by name; refused unless all have the same parameters and shapes."""
    folders = [
        (name if len(checkpoints) == 1 else str(folder), folder)
        for c in checkpoints
        for name, folder in model_folders(c)
    ]
    if len({folder.resolve() for _, folder in folders}) < len(folders):
        raise CheckpointError("a checkpoint is given twice: name each island once.")
    found = [(name, load_full_model_state(folder)) for name, folder in folders]
    first_name, first = found[0]
    for name, state in found[1:]:
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        want = {k: tuple(v.shape) for k, v in first.items()}
        if shapes != want:
            differ = sorted(k for k in shapes.keys() | want.keys() if shapes.get(k) != want.get(k))
            raise CheckpointError(
                f"'{name}' and '{first_name}' hold different models ({', '.join(differ[:6])}"
                f"{' ...' if len(differ) > 6 else ''} differ): merge checkpoints of one model."
            )
    return found


def held_out(checkpoint: str | Path, eval_bytes: int) -> PackedText:
    """The text after what the checkpoint's run trained on: same files, from its ``data.max_bytes`` on."""
    from tessera.config import parse_config

    meta = read_meta(checkpoint)
    if "config" not in meta:
        raise CheckpointError(f"checkpoint '{checkpoint}' records no training config: its held-out text is unknown.")
    cfg = parse_config(meta["config"], source=f"the config stored in '{checkpoint}'")
    from tessera.models.described import tokenizer_for

    if cfg.data.prepared:
        raise CheckpointError(
            f"the run of '{checkpoint}' trained on data.prepared shards, and merge judges on the text that follows "
            "data.max_bytes of data.paths: there is none to read (held-out shards are not supported yet)."
        )

    files, tokenizer = resolve_paths(cfg.data.paths), tokenizer_for(cfg)  # a tokenizer's own error is not this
    try:
        return PackedText(files, cfg.data.seq_len, eval_bytes, skip_bytes=cfg.data.max_bytes, tokenizer=tokenizer)
    except ValueError:
        raise CheckpointError(
            f"the corpus of '{checkpoint}' has no held-out text: the run trained on its first data.max_bytes="
            f"{cfg.data.max_bytes} bytes and little or nothing follows; train with a lower data.max_bytes."
        ) from None


def _model(checkpoint: str | Path) -> nn.Module:
    from tessera.config import parse_config
    from tessera.models.build import build_model

    config = parse_config(read_meta(checkpoint)["config"], source=f"the config in '{checkpoint}'")
    return build_model(config, weights=False)  # the checkpoint's weights are loaded into it


@torch.no_grad()
def _log_probs(model: nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    model.load_state_dict(state, strict=True)
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out
    return F.log_softmax(logits.float(), dim=-1)


def merge(checkpoints: list[str | Path], eval_bytes: int = 1 << 17) -> tuple[MergeReport, dict[str, torch.Tensor]]:
    """Judge every island of ``checkpoints``, their parameter average and their uniform ensemble on
    ``eval_bytes`` of held-out text; return the report and the averaged parameters."""
    found = islands(checkpoints)
    average = {
        k: sum(state[k].double() for _, state in found).div(len(found)).to(v.dtype) for k, v in found[0][1].items()
    }
    data = held_out(checkpoints[0], eval_bytes)
    model = _model(checkpoints[0]).eval()
    names = [name for name, _ in found]
    sums = dict.fromkeys([*names, "average", "ensemble"], 0.0)
    tokens = 0
    for start in range(0, len(data), EVAL_BATCH):
        batch = [data[i] for i in range(start, min(start + EVAL_BATCH, len(data)))]
        x, y = torch.stack([b["x"] for b in batch]), torch.stack([b["y"] for b in batch]).flatten()
        each = [_log_probs(model, state, x).flatten(0, 1) for _, state in found]
        for name, log_probs in zip(names, each):
            sums[name] += F.nll_loss(log_probs, y, reduction="sum").item()
        sums["average"] += F.nll_loss(_log_probs(model, average, x).flatten(0, 1), y, reduction="sum").item()
        ensemble = torch.logsumexp(torch.stack(each), dim=0) - math.log(len(each))  # log of the mean probability
        sums["ensemble"] += F.nll_loss(ensemble, y, reduction="sum").item()
        tokens += y.numel()
    return MergeReport({name: total / tokens for name, total in sums.items()}, tokens), average
