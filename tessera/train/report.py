"""What a training run tells: one metrics record per reported step (rank 0 writes ``metrics.jsonl``; every
rank joins the per-rank byte counts), the live progress line, the experts' routing, and at the end the loss
and expert plots and the traffic each link class carried."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import tessera
from tessera import log, trackers, traffic
from tessera.config import Config
from tessera.parallel.compile import RecompileWatch
from tessera.train.metrics import MetricsLog, Progress, plot_experts, plot_loss


@dataclass
class StepNumbers:
    """What one reported step measured on this rank."""

    loss: float  # the global batch's
    lr: float
    grad_norm: float
    state_bytes: int
    step_time_s: float
    elapsed_s: float  # since the run (re)started
    steps_done: int  # since the run (re)started
    peak_bytes: int | None = None  # at train.measure_memory_at
    held_out: float | None = None  # the held-out loss, when evaluated


LOG = log.get("train")


class RunReport:
    """The reports of one run (``rank0``: this rank writes them), from step ``start_step`` on."""

    def __init__(
        self,
        cfg: Config,
        booster: tessera.Booster,
        experts: list[Any],
        flops_per_token: float,
        job_peak: float | None,
        start_step: int,
        resumed: bool,
    ) -> None:
        self.cfg, self.booster, self.experts = cfg, booster, experts
        self.flops_per_token, self.job_peak = flops_per_token, job_peak
        rank0 = dist.get_rank() == 0
        self.log = _metrics_log(cfg, start_step if resumed else None) if rank0 else None
        self.progress = Progress(cfg.train.steps, enabled=rank0 and cfg.logging.progress)
        self.traffic = {link: traffic.LinkTraffic() for link in traffic.LINKS}  # the job's, over the steps run
        self.start_step = self.reported_step = start_step
        self.crowded_reports = 0  # reported steps in a row where one expert took more than moe.warn_share
        self.compiles = RecompileWatch() if booster.plan.compile != "none" else None
        traffic.take()  # from here on: the steps' traffic (set-up and restore are not steps)

    def step(self, step: int, epoch: int, numbers: StepNumbers) -> None:
        """The record of ``step`` (every rank calls it: one gather of what every rank knows)."""
        # Every rank's state bytes, its peak (at train.measure_memory_at, the same step on every rank) and what
        # it sent.
        gathered: list[tuple] = [()] * dist.get_world_size()
        dist.all_gather_object(gathered, (numbers.state_bytes, numbers.peak_bytes or 0, traffic.take()))
        per_rank_bytes, per_rank_peaks, per_rank_traffic = (list(column) for column in zip(*gathered))
        sent = traffic.job_traffic(per_rank_traffic)
        steps = max(1, step - self.reported_step)
        self.reported_step = step
        self.traffic = {link: self.traffic[link] + sent[link] for link in traffic.LINKS}
        if self.log is None:
            return
        compiled, storm = self.compiles.report() if self.compiles is not None else ({}, None)
        # compile time is reported on its own (compile_s), not in the speed
        running_s = max(numbers.elapsed_s - compiled.get("compile_s", 0.0), 1e-9)
        tok_s = numbers.steps_done * self.cfg.train.global_batch_size * self.cfg.data.seq_len / running_s
        record = {
            "step": step,
            "loss": numbers.loss,
            "lr": numbers.lr,
            "grad_norm": numbers.grad_norm,
            "tokens_per_s": tok_s,
            "step_time_s": numbers.step_time_s,
            "achieved_tflops": tok_s * self.flops_per_token / 1e12,
            "model_state_bytes_rank0": numbers.state_bytes,
            "model_state_bytes_per_rank": per_rank_bytes,
            "epoch": epoch,
            # every rank's collectives since the last record, per link class (tessera.traffic)
            "comm_bytes_per_step": {link: t.bytes / steps for link, t in sent.items()},
            "comm_gbit_s": {link: t.gbit_s for link, t in sent.items()},
        }
        if numbers.peak_bytes is not None:
            record["peak_tensor_bytes_per_rank"] = per_rank_peaks
        if (held := numbers.held_out) is not None:  # TensorBoard and the loss plot take them from here
            record["val_loss"], record["val_perplexity"] = held, math.exp(min(held, 80.0))
        if syncs := self.booster.membership.new_syncs():
            record["outer_syncs"] = syncs
        if self.job_peak:
            record["mfu"] = record["achieved_tflops"] / self.job_peak
        if self.experts:
            record.update(self._expert_metrics())
        record.update(compiled)  # compile time apart from step time, and recompilations counted
        if storm:
            LOG.warning(storm)
        self.log.log(record)
        self.progress.update(step, numbers.loss, tok_s, numbers.elapsed_s, numbers.steps_done)

    def _expert_metrics(self) -> dict[str, Any]:
        """Each MoE layer's routed slots per expert in the last step's whole batch, the mean balance loss; a
        warning when one expert has taken more than ``moe.warn_share`` of a layer's slots at
        ``moe.warn_steps`` reported steps in a row."""
        routed = [layer.routed.tolist() for layer in self.experts]
        moe = self.cfg.model.moe
        crowded = [(i, max(counts), sum(counts)) for i, counts in enumerate(routed) if sum(counts)]
        worst = max(crowded, key=lambda c: c[1] / c[2], default=None)
        if moe is not None and worst is not None and worst[1] / worst[2] > moe.warn_share:
            self.crowded_reports += 1
            if self.crowded_reports == moe.warn_steps:
                layer, top, total = worst
                LOG.warning(f"in MoE layer {layer} one expert took {top / total:.0%} of the routed slots "
                            f"(> model.moe.warn_share={moe.warn_share}) at {moe.warn_steps} reported steps in a row: "
                            "raise model.moe.aux_loss_weight or set model.moe.bias_rate")  # fmt: skip
        else:
            self.crowded_reports = 0
        losses = [float(layer.balance_loss) for layer in self.experts]
        return {"tokens_per_expert": routed, "balance_loss": sum(losses) / len(losses)}

    def finish(self, losses: list[float], step: int, title: str, sample: str) -> dict[str, Any]:
        """Close the log, draw the curves, print the summary (rank 0); the traffic the job's steps carried."""
        if self.log is not None:
            cfg = self.cfg
            self.log.close()
            plot_loss(self.log.path, cfg.run_dir / "loss.png", title)
            if self.experts:
                plot_experts(self.log.path, cfg.run_dir / "experts.png", title)
            if losses:
                LOG.info(
                    f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps {self.start_step + 1}-{step}; "
                    f"metrics: {self.log.path}; plot: {cfg.run_dir / 'loss.png'}"
                )
            self._print_traffic()
            if self.compiles is not None:
                LOG.info(f"compiled blocks: {self.compiles.graphs} graphs in {self.compiles.seconds:.1f} s of "
                         "compiling (left out of tokens/s)")  # fmt: skip
            if sample:
                LOG.info("sample:\n%s", sample)
        return {
            link: {"bytes": t.bytes, "collectives": t.collectives, "gbit_s": t.gbit_s}
            for link, t in self.traffic.items()
        }

    def _print_traffic(self) -> None:
        """The end-of-run line: bytes per step and achieved bandwidth of each link class the job used."""
        steps = max(1, self.reported_step - self.start_step)
        parts = [
            f"{link.replace('_', '-')} {t.bytes / steps / 1e6:.3g} MB/step"
            + (f" at {t.gbit_s:.3g} Gbit/s" if t.gbit_s else "")
            for link, t in self.traffic.items()
            if t.collectives
        ]
        if parts:
            LOG.info("sent by all ranks: %s", "; ".join(parts))


def _metrics_log(cfg: Config, resume_step: int | None) -> MetricsLog:
    """metrics.jsonl, mirrored to the trackers the config chooses (checked before launch)."""
    names = trackers.chosen(cfg.logging.trackers, cfg.logging.tensorboard)
    opened = trackers.open_trackers(
        names, cfg.run_dir, cfg.logging.run_name, cfg.logging.project, cfg.model_dump(mode="json"), resume_step
    )
    return MetricsLog(cfg.run_dir, resume_step, opened)
