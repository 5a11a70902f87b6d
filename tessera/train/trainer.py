"""The training loop behind ``tessera train``: a Trainer whose methods each do one job.

Runs inside a torchrun-launched process (or a plain one, as a 1-rank job).
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset, Subset

import tessera
from tessera import faults, traffic
from tessera.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tessera.cluster.emulate import hooks_from_environment
from tessera.data.instructions import InstructionData
from tessera.data.shards import TokenShards
from tessera.data.text import ByteTokenizer, PackedText, resolve_paths
from tessera.memory import release_free_heap
from tessera.models.moe import moe_layers
from tessera.parallel.data_parallel import unwrap as data_parallel_unwrap
from tessera.testbed.seat import current_seat, verify_seat
from tessera.train import rundir
from tessera.train.build import base_record, build_model, build_optimizer, check_base_of, tokenizer_for
from tessera.train.config import Config, ConfigError, plan_from_config
from tessera.train.failures import CollectiveTimeout
from tessera.train.metrics import (
    MetricsLog,
    Progress,
    job_peak_tflops,
    plot_experts,
    plot_loss,
    transformer_flops_per_token,
)

HEAP_TRIM_EVERY = 100  # steps between giving the C heap's free pages back (benchmarks/soak.py)


def lr_factor(cfg: Config, step: int) -> float:
    """Warm-up, then cosine / linear decay to ``min_lr_ratio`` (or constant)."""
    s, total = cfg.schedule, cfg.train.steps
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return 1.0
    progress = min(1.0, (step - s.warmup_steps) / max(1, total - s.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if s.kind == "cosine" else 1 - progress
    return s.min_lr_ratio + (1 - s.min_lr_ratio) * decay


def logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def next_token_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_of(output).float().flatten(0, 1), targets.flatten())


def split_validation(dataset: Dataset, share: float, global_batch: int) -> tuple[Dataset, Dataset | None]:
    """The training sequences and the held-out ones (the last ``share`` of them; None when 0)."""
    if not share:
        return dataset, None
    n = len(dataset)
    held = int(n * share)
    if held < global_batch or n - held < global_batch:
        raise ConfigError(
            f"data.validation={share} holds out {held} of the data's {n} sequences, but each side needs a global "
            f"batch (train.global_batch_size={global_batch}): change data.validation or add data."
        )
    return Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def response_token_loss(booster: tessera.Booster, batch: dict) -> Any:
    """Fine-tuning's loss for ``batch``: the mean over the global batch's response tokens (targets not
    -100), whatever the layout (:meth:`tessera.Booster.token_mean_scale`)."""
    scale = booster.token_mean_scale(batch["y"])

    def loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output).float().flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten(), reduction="sum") * scale

    return loss


def train_step(
    model: nn.Module,
    optimizer: Any,
    booster: tessera.Booster,
    batch: dict,
    grad_clip: float | None,
    step: int,
    timeout_s: float,
    loss_fn: Any = next_token_loss,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Forward, backward, clip, optimizer step; returns (local loss, grad norm, model-state bytes).

    A collective that times out becomes a CollectiveTimeout naming the group and the step.
    """
    try:
        loss = booster.execute_pipeline(batch, model, loss_fn, optimizer)
        grad_norm = booster.clip_grad_norm(model, optimizer, max_norm=grad_clip or math.inf)
        optimizer.step()
        state_bytes = int(tessera.memory.model_state_bytes(model, optimizer))
        optimizer.zero_grad()
        return loss, grad_norm, state_bytes
    except RuntimeError as exc:
        if not _is_timeout(exc):
            raise
        if booster.plan.replicas is None:
            where = f"the data-parallel group 'dp' (ranks {dist.get_process_group_ranks(booster.mesh.get_group('dp'))})"
        else:
            where = f"the ranks of Plan.replicas (0-{dist.get_world_size() - 1})"
        raise CollectiveTimeout(
            f"a collective of step {step} on {where} did not complete "
            f"within train.timeout_s={timeout_s:g} s on rank {dist.get_rank()}: another rank died, hung or never "
            "arrived. Check that rank's log; restart with --resume to continue from the last checkpoint."
        ) from None


@torch.no_grad()
def generate(model: nn.Module, prompt: str, n_bytes: int, seq_len: int, device: torch.device, tok: Any = None) -> str:
    """Sample ``n_bytes`` tokens (bytes, with the byte tokenizer) after ``prompt``; every rank runs it (sharded
    models need all ranks). ``tok``: the run's tokenizer (bytes by default)."""
    tok = tok or ByteTokenizer()
    tokens = torch.tensor([tok.encode(prompt)], device=device)
    g = torch.Generator(device=device).manual_seed(0)  # same draws on every rank
    # Sequence-parallel modules would expect a slice of the sequence: generate on the whole one.
    sp_modules = [(m, m.sp_group) for m in model.modules() if getattr(m, "sp_group", None) is not None]
    for m, _ in sp_modules:
        m.sp_group = None
    model.eval()
    try:
        for _ in range(n_bytes):
            logits = logits_of(model(tokens[:, -seq_len:]))
            if isinstance(logits, DTensor):  # Plan.loss_parallel: split over the vocabulary
                logits = logits.full_tensor()
            logits = logits[:, -1].float()
            probs = torch.softmax(logits / 0.8, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], dim=1)
    finally:
        model.train()
        for m, group in sp_modules:
            m.sp_group = group
    return tok.decode(tokens[0].tolist())


class Trainer:
    """One training run: set-up from the config, then ``run()``; each method does one job."""

    def __init__(self, cfg: Config, overwrite: bool = False) -> None:
        """``overwrite``: a fresh run (``checkpoint.resume: never``) may delete another run's files in its
        run directory instead of refusing to start (see :mod:`tessera.train.rundir`)."""
        self.cfg = cfg
        tessera.init(timeout_s=cfg.train.timeout_s)
        torch.manual_seed(cfg.train.seed)
        self.emulation = hooks_from_environment()  # tessera train --emulate CLUSTER
        self.booster = tessera.Booster(plan_from_config(cfg.plan), hooks=self.emulation)
        self.rank0 = dist.get_rank() == 0
        if self.emulation is not None:  # every rank says which device it plays: the run is emulated
            print(f"EMULATED: rank {dist.get_rank()} is {self.emulation.describe()}", flush=True)
        if (seat := current_seat()) is not None:  # tessera train --testbed: checked with the kernel, then said
            print(f"TESTBED: {verify_seat(seat)}", flush=True)
        self.tokenizer = tokenizer_for(cfg)
        self.fine_tuning = bool(cfg.data.instructions)  # the loss on response tokens only
        if self.fine_tuning:
            dataset = InstructionData(
                resolve_paths(cfg.data.instructions),
                self.tokenizer,
                cfg.data.seq_len,
                cfg.data.on_bad_record,
                pack=cfg.data.pack,
            )
        elif cfg.data.prepared:
            dataset = TokenShards(cfg.data.prepared, cfg.data.seq_len)
        else:
            dataset = PackedText(resolve_paths(cfg.data.paths), cfg.data.seq_len, cfg.data.max_bytes, 0, self.tokenizer)
        model = build_model(cfg)
        self.n_params = sum(p.numel() for p in model.parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.model, self.optimizer = self.booster.boost(model, build_optimizer(cfg, trainable))
        self.experts = moe_layers(model)
        self.crowded_reports = 0  # reported steps in a row where one expert took more than moe.warn_share
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(cfg, s))
        train_set, held_out = split_validation(dataset, cfg.data.validation, cfg.train.global_batch_size)
        self.loader = self.booster.dataloader(train_set, cfg.train.global_batch_size, seed=cfg.train.seed)
        self.val_loader = (
            self.booster.dataloader(held_out, cfg.train.global_batch_size, seed=cfg.train.seed, shuffle=False)
            if held_out is not None
            else None
        )
        self.ckpt_root = cfg.run_dir / "checkpoints"
        self.step, self.epoch, self.batch_in_epoch = 0, 0, 0
        self.saving = False  # where() tells a failure inside a save from one inside a step
        self.owner = rundir.claim(cfg.run_dir, cfg.checkpoint.resume, overwrite)
        self.resumed_from = self._restore() if self.owner.resume else self._restore_group_from_its_run()
        self.job_peak = job_peak_tflops(cfg.train.peak_tflops, self.booster.device)  # may refuse: no file yet
        self.flops_per_token = self._flops_per_token()
        self.losses: list[float] = []
        self.traffic = {link: traffic.LinkTraffic() for link in traffic.LINKS}  # the job's, over the steps run
        self.reported_step = 0

    def _restore(self, path: Path | None = None) -> Path | None:
        """Continue from ``path``, or from this run's newest complete checkpoint, if there is one."""
        path = path or latest_checkpoint(self.ckpt_root, self.owner.run_id)
        if path is None:
            return None
        check_base_of(path, self.cfg)
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.schedule.load_state_dict(state["scheduler"])
        if self.booster.scaler is not None and state.get("scaler"):
            self.booster.scaler.load_state_dict(state["scaler"])
        if self.rank0:
            print(f"resumed from {path} at step {self.step}", flush=True)
        return path

    def _restore_group_from_its_run(self) -> Path | None:
        """A fault-tolerant group's job asked to resume (``--resume``) with no checkpoint of its own yet: it
        starts from the newest checkpoint of the run it is a group of (``RUN_DIR``, one model trained
        before the plan had groups: a warm start), as groups in one job do. None when there is none."""
        if not (self.booster.membership.fault_tolerant and self.cfg.checkpoint.resume == "auto"):
            return None
        path = latest_checkpoint(self.cfg.run_dir.parent / "checkpoints")
        if path is not None and self.rank0:
            print(f"group {self.booster.group_index} has no checkpoint of its own: starts from {path}", flush=True)
        return self._restore(path) if path is not None else None

    def _flops_per_token(self) -> float:
        hf_cfg = getattr(data_parallel_unwrap(self.model), "config", None)  # a config-built model knows its sizes
        n_layers = getattr(hf_cfg, "num_hidden_layers", self.cfg.model.n_layers)
        dim = getattr(hf_cfg, "hidden_size", self.cfg.model.dim)
        return transformer_flops_per_token(self.n_params, n_layers, dim, self.cfg.data.seq_len)

    def where(self) -> str:
        """Where training is, for error reports: the step being trained or saved."""
        return f"saving the step-{self.step} checkpoint" if self.saving else f"step {self.step + 1}"

    def checkpoint(self) -> None:
        trainer_state = {
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "scheduler": self.schedule.state_dict(),
            "scaler": self.booster.scaler.state_dict() if self.booster.scaler else None,
        }
        meta = {
            "run_id": self.owner.run_id,
            "plan": self.booster.plan.to_dict(),
            "config": self.cfg.model_dump(mode="json"),
        }
        holds_base = self.cfg.checkpoint_holds_base
        if not holds_base:  # LoRA adapters alone: the base is read again from these files
            meta["base"] = base_record(self.cfg)
        self.saving = True
        save_checkpoint(
            self.ckpt_root, self.step, self.model, self.optimizer, trainer_state, self.cfg.checkpoint.keep, meta,
            frozen=holds_base,
        )  # fmt: skip
        self.saving = False

    def run(self) -> dict[str, Any]:
        """Train to ``train.steps`` (or ``stop_at``), checkpoint, report; return a summary on every rank."""
        cfg = self.cfg
        resume_step = self.step if self.resumed_from else None
        log = MetricsLog(cfg.run_dir, cfg.logging.tensorboard, resume_step) if self.rank0 else None
        progress = Progress(cfg.train.steps, enabled=self.rank0 and cfg.logging.progress)
        start_step, start_time = self.step, time.perf_counter()
        traffic.take()  # from here on: the steps' traffic (set-up and restore are not steps)
        self.reported_step = self.step
        last_step = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
        while self.step < last_step:
            self.loader.set_epoch(self.epoch, self.batch_in_epoch)
            for batch in self.loader:
                faults.before_step(self.step + 1)
                t0 = time.perf_counter()
                measured = self.step + 1 == cfg.train.measure_memory_at
                evaluated = bool(cfg.eval.every) and (
                    (self.step + 1) % cfg.eval.every == 0 or self.step + 1 == last_step
                )
                reported = (
                    measured
                    or evaluated
                    or (self.step + 1) % cfg.train.log_every == 0
                    or self.step + 1 in (start_step + 1, last_step)
                )
                traffic.timing(reported)  # the bandwidth of the steps reported: timing costs a callback each
                with self._peak_bytes() if measured else contextlib.nullcontext() as peak:
                    loss, grad_norm, state_bytes = train_step(
                        self.model,
                        self.optimizer,
                        self.booster,
                        batch,
                        cfg.optimizer.grad_clip,
                        self.step + 1,
                        cfg.train.timeout_s,
                        self._loss_for(batch),
                    )
                traffic.timing(False)
                lr = self.schedule.get_last_lr()[0]
                self.schedule.step()
                global_loss = self.booster.reduce_loss(loss).item()
                self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
                self.losses.append(global_loss)
                jumped = self._follow_the_groups()
                if reported:
                    timing = (time.perf_counter() - t0, time.perf_counter() - start_time, self.step - start_step)
                    peak_bytes = peak[0] if measured else None
                    held = self.evaluate() if evaluated else None
                    self._report(log, progress, global_loss, lr, float(grad_norm), state_bytes, timing, peak_bytes,
                                 held)  # fmt: skip
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.checkpoint()
                if self.step % HEAP_TRIM_EVERY == 0:
                    release_free_heap()  # freed buffers back to the OS: resident memory stays flat
                if self.step >= last_step or jumped:  # jumped: read on from the new place in the data
                    break
            else:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        progress.close()
        if not cfg.checkpoint.every or self.step % cfg.checkpoint.every:
            self.checkpoint()
        return self._finish(log, start_step)

    def _loss_for(self, batch: dict) -> Any:
        return response_token_loss(self.booster, batch) if self.fine_tuning else next_token_loss

    def evaluate(self) -> float:
        """The mean loss over the first ``eval.batches`` global batches of held-out sequences (every rank)."""
        assert self.val_loader is not None
        self.val_loader.set_epoch(0, 0)
        losses = []
        for batch in self.val_loader:
            loss = self.booster.evaluate(batch, self.model, self._loss_for(batch))
            losses.append(float(self.booster.reduce_loss(loss)))
            if len(losses) == self.cfg.eval.batches:
                break
        return sum(losses) / len(losses)

    def _follow_the_groups(self) -> bool:
        """Under fault-tolerant Plan.groups a group that came back takes a live group's step count at its
        first outer sync: move the data, the schedule and the step to it. True when it moved."""
        step = self.booster.membership.inner_step
        if not self.booster.membership.fault_tolerant or step is None or step == self.step:
            return False
        if self.rank0:
            print(f"group {self.booster.group_index} rejoined: took step {step} from a live group "
                  f"(was at {self.step})", flush=True)  # fmt: skip
        self.step = step
        self.epoch, self.batch_in_epoch = divmod(self.step, len(self.loader))
        self.schedule.last_epoch = self.step - 1
        self.schedule.step()  # the learning rate of that step
        return True

    def _report(
        self,
        log: MetricsLog | None,
        progress: Progress,
        loss: float,
        lr: float,
        grad_norm: float,
        state_bytes: int,
        timing: tuple[float, float, int],
        peak_bytes: int | None = None,
        held_out: float | None = None,
    ) -> None:
        """One metrics record (rank 0 writes it; every rank joins the per-rank byte counts)."""
        # One gather of what every rank knows: its state bytes, its peak (at train.measure_memory_at, the
        # same step on every rank) and what it sent.
        gathered: list[tuple] = [()] * dist.get_world_size()
        dist.all_gather_object(gathered, (state_bytes, peak_bytes or 0, traffic.take()))
        per_rank_bytes, per_rank_peaks, per_rank_traffic = (list(column) for column in zip(*gathered))
        sent = traffic.job_traffic(per_rank_traffic)
        steps = max(1, self.step - self.reported_step)
        self.reported_step = self.step
        self.traffic = {link: self.traffic[link] + sent[link] for link in traffic.LINKS}
        if log is None:
            return
        step_time, elapsed, done = timing
        tok_s = done * self.cfg.train.global_batch_size * self.cfg.data.seq_len / elapsed
        record = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tok_s,
            "step_time_s": step_time,
            "achieved_tflops": tok_s * self.flops_per_token / 1e12,
            "model_state_bytes_rank0": state_bytes,
            "model_state_bytes_per_rank": per_rank_bytes,
            "epoch": self.epoch,
            # every rank's collectives since the last record, per link class (tessera.traffic)
            "comm_bytes_per_step": {link: t.bytes / steps for link, t in sent.items()},
            "comm_gbit_s": {link: t.gbit_s for link, t in sent.items()},
        }
        if peak_bytes is not None:
            record["peak_tensor_bytes_per_rank"] = per_rank_peaks
        if held_out is not None:  # TensorBoard and the loss plot take them from here
            record["val_loss"], record["val_perplexity"] = held_out, math.exp(min(held_out, 80.0))
        if syncs := self.booster.membership.new_syncs():
            record["outer_syncs"] = syncs
        if self.job_peak:
            record["mfu"] = record["achieved_tflops"] / self.job_peak
        if self.experts:
            record.update(self._expert_metrics())
        log.log(record)
        progress.update(self.step, loss, tok_s, elapsed, done)

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
                print(f"warning: in MoE layer {layer} one expert took {top / total:.0%} of the routed slots "
                      f"(> model.moe.warn_share={moe.warn_share}) at {moe.warn_steps} reported steps in a row: "
                      "raise model.moe.aux_loss_weight or set model.moe.bias_rate", flush=True)  # fmt: skip
        else:
            self.crowded_reports = 0
        losses = [float(layer.balance_loss) for layer in self.experts]
        return {"tokens_per_expert": routed, "balance_loss": sum(losses) / len(losses)}

    def _peak_bytes(self) -> contextlib.AbstractContextManager[list[int]]:
        """Peak tensor bytes of one step on this rank (train.measure_memory_at)."""
        held = int(tessera.memory.model_state_bytes(self.model, self.optimizer))
        return tessera.memory.peak_tensor_bytes(self.booster.device, held)

    def _finish(self, log: MetricsLog | None, start_step: int) -> dict[str, Any]:
        """Sample some text, close the log, draw the curve, print the summary."""
        cfg, losses = self.cfg, self.losses
        # A pipeline stage cannot generate alone: sampling would need a pipelined decode loop.
        sample = (
            generate(self.model, "def ", cfg.train.sample_bytes, cfg.data.seq_len, self.booster.device, self.tokenizer)
            if cfg.train.sample_bytes and not self.booster.plan.pipelined
            else ""
        )
        if log is not None:
            log.close()
            title = (
                f"{cfg.logging.run_name}: {self.n_params / 1e6:.2f}M params, "
                f"plan zero={self.booster.plan.zero}, {dist.get_world_size()} ranks"
                + (" (EMULATED cluster)" if self.emulation is not None else "")
            )
            plot_loss(log.path, cfg.run_dir / "loss.png", title)
            if self.experts:
                plot_experts(log.path, cfg.run_dir / "experts.png", title)
            if losses:
                print(
                    f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps {start_step + 1}-{self.step}; "
                    f"metrics: {log.path}; plot: {cfg.run_dir / 'loss.png'}",
                    flush=True,
                )
            self._print_traffic(start_step)
            if sample:
                print("sample:\n" + sample, flush=True)
        return {
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "steps": self.step,
            "run_dir": str(cfg.run_dir),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "traffic": {
                link: {"bytes": t.bytes, "collectives": t.collectives, "gbit_s": t.gbit_s}
                for link, t in self.traffic.items()
            },
        }

    def _print_traffic(self, start_step: int) -> None:
        """The end-of-run line: bytes per step and achieved bandwidth of each link class the job used."""
        steps = max(1, self.reported_step - start_step)
        parts = [
            f"{link.replace('_', '-')} {t.bytes / steps / 1e6:.3g} MB/step"
            + (f" at {t.gbit_s:.3g} Gbit/s" if t.gbit_s else "")
            for link, t in self.traffic.items()
            if t.collectives
        ]
        if parts:
            print("sent by all ranks: " + "; ".join(parts), flush=True)


def train(cfg: Config) -> dict[str, Any]:
    """Train as ``cfg`` says; return a summary (first/last loss, steps, paths) on every rank."""
    return Trainer(cfg).run()
