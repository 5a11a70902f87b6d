"""The training loop behind ``tessera train``: a Trainer whose methods each do one job.

Runs inside a torchrun-launched process (or a plain one, as a 1-rank job). A step is
:func:`tessera.train.step.train_step`; what a run reports is :mod:`tessera.train.report`'s.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import tessera
from tessera import faults, log, traffic
from tessera.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tessera.checkpoint.readers import read_trainer_state
from tessera.config import Config, plan_from_config
from tessera.launch import rundir
from tessera.memory import release_free_heap
from tessera.models.build import build_model
from tessera.models.described import tokenizer_for
from tessera.models.moe import moe_layers
from tessera.models.pretrained import base_record, check_base_of
from tessera.parallel.data_parallel import unwrap as data_parallel_unwrap
from tessera.testbed.emulate import hooks_from_environment
from tessera.testbed.seat import current_seat, verify_seat
from tessera.train.data import training_data
from tessera.train.metrics import job_peak_tflops, transformer_flops_per_token
from tessera.train.optimizer import build_optimizer
from tessera.train.report import RunReport, StepNumbers
from tessera.train.step import generate, lr_factor, next_token_loss, response_token_loss, train_step

LOG = log.get("train")
HEAP_TRIM_EVERY = 100  # steps between giving the C heap's free pages back (benchmarks/soak.py)


class Trainer:
    """One training run: set-up from the config, then ``run()``; each method does one job."""

    def __init__(self, cfg: Config, overwrite: bool = False) -> None:
        """``overwrite``: a fresh run, whatever ``checkpoint.resume`` says, that deletes another run's files in
        its run directory instead of refusing to start or resuming it (see :mod:`tessera.launch.rundir`)."""
        self.cfg = cfg
        log.ensure()
        tessera.init(timeout_s=cfg.train.timeout_s)
        torch.manual_seed(cfg.train.seed)
        self.emulation = hooks_from_environment()  # tessera train --emulate CLUSTER
        self.booster = tessera.Booster(plan_from_config(cfg.plan), hooks=self.emulation)
        self.rank0 = dist.get_rank() == 0
        if self.emulation is not None:  # every rank says which device it plays: the run is emulated
            LOG.info("EMULATED: rank %d is %s", dist.get_rank(), self.emulation.describe())
        if (seat := current_seat()) is not None:  # tessera train --testbed: checked with the kernel, then said
            LOG.info("TESTBED: %s", verify_seat(seat))
        self.tokenizer = tokenizer_for(cfg)
        self.fine_tuning = bool(cfg.data.instructions)  # the loss on response tokens only
        train_set, held_out = training_data(cfg, self.tokenizer)
        model = build_model(cfg)
        self.n_params = sum(p.numel() for p in model.parameters())
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        if self.rank0:
            n_trainable = sum(p.numel() for p in trainable)
            LOG.info(f"parameters: {self.n_params:,}, trainable {n_trainable:,} ({n_trainable / self.n_params:.2%})")
        self.model, self.optimizer = self.booster.boost(model, build_optimizer(cfg, trainable))
        self.experts = moe_layers(model)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(cfg, s))
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
        fresh = overwrite or self.owner.resume
        self.resumed_from = (
            self._restore() if self.owner.resume else None if fresh else self._restore_group_from_its_run()
        )
        self.job_peak = job_peak_tflops(cfg.train.peak_tflops, self.booster.device)  # may refuse: no file yet
        self.flops_per_token = self._flops_per_token()
        self.losses: list[float] = []

    def _restore(self, path: Path | None = None) -> Path | None:
        """Continue from ``path``, or from this run's newest complete checkpoint, if there is one."""
        path = path or latest_checkpoint(self.ckpt_root, self.owner.run_id)
        if path is None:
            return None
        check_base_of(path, self.cfg.model.pretrained)
        read_trainer_state(path)  # refused before any weight is loaded: a corrupted trainer.pt is named
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.schedule.load_state_dict(state["scheduler"])
        if self.booster.scaler is not None and state.get("scaler"):
            self.booster.scaler.load_state_dict(state["scaler"])
        if self.rank0:
            LOG.info("resumed from %s at step %d", path, self.step)
        return path

    def _restore_group_from_its_run(self) -> Path | None:
        """A fault-tolerant group's job asked to resume (``--resume``) with no checkpoint of its own yet: it
        starts from the newest checkpoint of the run it is a group of (``RUN_DIR``, one model trained
        before the plan had groups: a warm start), as groups in one job do. None when there is none."""
        if not (self.booster.membership.fault_tolerant and self.cfg.checkpoint.resume == "auto"):
            return None
        path = latest_checkpoint(self.cfg.run_dir.parent / "checkpoints")
        if path is not None and self.rank0:
            LOG.info("group %s has no checkpoint of its own: starts from %s", self.booster.group_index, path)
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
            assert self.cfg.model.pretrained is not None, "the config refuses checkpoint.base: false without it"
            meta["base"] = base_record(self.cfg.model.pretrained)
        self.saving = True
        save_checkpoint(
            self.ckpt_root, self.step, self.model, self.optimizer, trainer_state, self.cfg.checkpoint.keep, meta,
            frozen=holds_base,
        )  # fmt: skip
        self.saving = False

    def run(self) -> dict[str, Any]:
        """Train to ``train.steps`` (or ``stop_at``), checkpoint, report; return a summary on every rank."""
        cfg = self.cfg
        report = RunReport(cfg, self.booster, self.experts, self.flops_per_token, self.job_peak, self.step,
                           resumed=self.resumed_from is not None)  # fmt: skip
        start_step, start_time = self.step, time.perf_counter()
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
                traffic.timing(reported)  # the bandwidth of the steps reported: a callback each
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
                    numbers = StepNumbers(
                        global_loss, lr, float(grad_norm), state_bytes, time.perf_counter() - t0,
                        time.perf_counter() - start_time, self.step - start_step,
                        peak[0] if measured else None, self.evaluate() if evaluated else None,
                    )  # fmt: skip
                    report.step(self.step, self.epoch, numbers)
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.checkpoint()
                if self.step % HEAP_TRIM_EVERY == 0:
                    release_free_heap()  # freed buffers back to the OS: resident memory stays flat
                if self.step >= last_step or jumped:  # jumped: read on from the new place in the data
                    break
            else:
                self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        report.progress.close()
        if not cfg.checkpoint.every or self.step % cfg.checkpoint.every:
            self.checkpoint()
        return self._finish(report)

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
            LOG.info("group %s rejoined: took step %d from a live group (was at %d)", self.booster.group_index, step,
                     self.step)  # fmt: skip
        self.step = step
        self.epoch, self.batch_in_epoch = divmod(self.step, len(self.loader))
        self.schedule.last_epoch = self.step - 1
        self.schedule.step()  # the learning rate of that step
        return True

    def _peak_bytes(self) -> contextlib.AbstractContextManager[list[int]]:
        """Peak tensor bytes of one step on this rank (train.measure_memory_at)."""
        held = int(tessera.memory.model_state_bytes(self.model, self.optimizer))
        return tessera.memory.peak_tensor_bytes(self.booster.device, held)

    def _finish(self, report: RunReport) -> dict[str, Any]:
        """Sample some text, close the reports, draw the curves, print the summary; the run's summary."""
        cfg, losses = self.cfg, self.losses
        # A pipeline stage cannot generate alone: sampling would need a pipelined decode loop.
        sample = (
            generate(self.model, "def ", cfg.train.sample_bytes, cfg.data.seq_len, self.booster.device, self.tokenizer)
            if cfg.train.sample_bytes and not self.booster.plan.pipelined
            else ""
        )
        title = (
            f"{cfg.logging.run_name}: {self.n_params / 1e6:.2f}M params, "
            f"plan zero={self.booster.plan.zero}, {dist.get_world_size()} ranks"
            + (" (EMULATED cluster)" if self.emulation is not None else "")
        )
        sent = report.finish(losses, self.step, title, sample)
        return {
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "steps": self.step,
            "run_dir": str(cfg.run_dir),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "traffic": sent,
        }


def train(cfg: Config) -> dict[str, Any]:
    """Train as ``cfg`` says; return a summary (first/last loss, steps, paths) on every rank."""
    return Trainer(cfg).run()
