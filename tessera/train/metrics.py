"""What a run reports: a progress line, metrics.jsonl (always), the trackers it names, a loss PNG.

Only rank 0 reports; every figure is for the whole job (global-batch loss, all ranks' tokens).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera import log

if TYPE_CHECKING:
    from tessera.trackers import Tracker


def transformer_flops_per_token(n_params: int, n_layers: int, dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·N for the weights plus 12·L·d·s for attention (PaLM appendix B)."""
    return 6.0 * n_params + 12.0 * n_layers * dim * seq_len


def device_type(device: Any) -> str:
    """The name MFU peaks are declared under: torch's CUDA device name, or 'cpu'."""
    import torch

    return torch.cuda.get_device_name(device) if getattr(device, "type", "cpu") == "cuda" else "cpu"


def job_peak_tflops(peak: float | dict[str, float] | None, device: Any) -> float | None:
    """Sum of the declared peaks of every rank's device (all ranks must call this)."""
    import torch.distributed as dist

    if peak is None:
        return None
    names: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(names, device_type(device))
    if not isinstance(peak, dict):
        return float(peak) * len(names)
    missing = sorted(set(names) - peak.keys())
    if missing:
        raise ValueError(
            f"train.peak_tflops names no peak for device type(s) {missing}: add them (known: {sorted(peak)})."
        )
    return sum(peak[n] for n in names)


class Progress:
    """Step, loss, tokens/s and the time left: a tqdm bar redrawn in place on a terminal, a plain log line per
    report otherwise (a file, a pipe, a batch system's log)."""

    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        self.total = total_steps
        self.enabled = enabled
        self.tty = sys.stdout.isatty()
        self.bar: Any = None

    def update(self, step: int, loss: float, tokens_per_s: float, elapsed: float, done_steps: int) -> None:
        if not self.enabled:
            return
        if self.tty:
            from tqdm import tqdm

            if self.bar is None:
                self.bar = tqdm(total=self.total, initial=step, unit="step", dynamic_ncols=True, file=sys.stdout)
            self.bar.set_postfix_str(f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s", refresh=False)
            self.bar.update(step - self.bar.n)
            return
        remaining = (self.total - step) * elapsed / max(done_steps, 1)
        log.get("train").info(
            f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
            f"ETA {int(remaining // 60)}:{int(remaining % 60):02d}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class MetricsLog:
    """Appends one JSON object per logged step to ``metrics.jsonl``; mirrors its numbers to the run's
    ``trackers`` (:mod:`tessera.trackers`)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, trackers: Sequence[Tracker] = ()) -> None:
        """The file is only ever appended to, so a crash can never lose records already written. A resumed
        run first appends ``{"event": "resumed", "step": resume_step}``: earlier records after that step
        came from steps the restart redoes, and readers (:func:`latest_records`) drop them."""
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        if resume_step is not None:
            self.file.write(json.dumps({"time": time.time(), "event": "resumed", "step": resume_step}) + "\n")
            self.file.flush()
        self.trackers = list(trackers)

    def log(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.trackers:
            scalars = scalars_of(record)
            for tracker in self.trackers:
                tracker.log(scalars, record["step"])

    def close(self) -> None:
        self.file.close()
        for tracker in self.trackers:
            tracker.close()


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as trackers take them: one curve per number, and per entry of a mapping
    (``comm_bytes_per_step/inter_node``); the step and the time are the axes, not curves."""
    scalars: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool) or key in ("step", "time"):
            continue
        if isinstance(value, (int, float)):
            scalars[key] = value
        elif isinstance(value, dict):
            scalars.update({f"{key}/{sub}": n for sub, n in value.items() if isinstance(n, (int, float))})
    return scalars


def latest_records(metrics_path: Path) -> list[dict[str, Any]]:
    """The step records of ``metrics.jsonl`` in step order, as the run finally took them: a resumed run
    redoes the steps after its checkpoint, so records past a ``resumed`` event's step that came before
    it are dropped. A torn last line (a crash mid-write) is skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        if record.get("event") == "resumed":  # steps after the checkpoint are redone: forget the first try
            by_step = {s: r for s, r in by_step.items() if s <= record["step"]}
        elif "event" not in record:
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def plot_loss(metrics_path: Path, out_png: Path, title: str) -> None:
    """Draw loss against step from ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in latest_records(metrics_path) if "loss" in r]
    steps, losses = [r["step"] for r in records], [r["loss"] for r in records]
    held = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, losses, color="tab:blue", label="training")
    if held:  # eval.every: the held-out loss beside it
        ax.plot(*zip(*held), color="tab:orange", marker="o", markersize=3, label="held out")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (global batch)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def plot_experts(metrics_path: Path, out_png: Path, title: str) -> None:
    """Draw each expert's share of the routed slots (all MoE layers together) against step, and the balance
    loss, from ``metrics.jsonl``'s ``tokens_per_expert`` and ``balance_loss``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in latest_records(metrics_path) if r.get("tokens_per_expert")]
    if not records:
        return
    steps = [r["step"] for r in records]
    totals = [[sum(column) for column in zip(*r["tokens_per_expert"])] for r in records]  # per expert, all layers
    fig, (shares, balance) = plt.subplots(1, 2, figsize=(10, 3.5), dpi=100)
    for expert in range(len(totals[0])):
        shares.plot(steps, [t[expert] / max(sum(t), 1) for t in totals], label=f"expert {expert}")
    shares.axhline(1 / len(totals[0]), color="grey", linestyle="--", linewidth=0.8)  # balanced
    shares.set_xlabel("step")
    shares.set_ylabel("share of routed slots")
    shares.legend(fontsize=7, ncol=2)
    balance.plot(steps, [r.get("balance_loss", float("nan")) for r in records], color="tab:red")
    balance.set_xlabel("step")
    balance.set_ylabel("balance loss (1: balanced)")
    for ax in (shares, balance):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)
