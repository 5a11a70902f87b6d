"""The training loop behind ``tessera train``: read top to bottom, one step at a time.

Runs inside a torchrun-launched process (or a plain one, as a 1-rank job).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tessera
from tessera.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tessera.data.text import ByteTokenizer, PackedText, resolve_paths
from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS
from tessera.parallel.data import unwrap as data_parallel_unwrap
from tessera.train.config import Config, plan_from_config
from tessera.train.metrics import MetricsLog, Progress, job_peak_tflops, plot_loss, transformer_flops_per_token


def build_model(cfg: Config) -> nn.Module:
    m, seq = cfg.model, cfg.data.seq_len
    vocab = ByteTokenizer.vocab_size
    if m.kind == "llama":
        from tessera.models import Llama, LlamaConfig

        return Llama(
            LlamaConfig(
                vocab_size=vocab,
                dim=m.dim,
                n_layers=m.n_layers,
                n_heads=m.n_heads,
                n_kv_heads=m.n_kv_heads,
                ffn_dim=m.ffn_dim,
                max_seq_len=seq,
                tie_embeddings=m.tie_embeddings,
            )
        )
    from tessera.models import hf

    if m.kind == "hf_config":
        return hf.from_config_file(m.hf_config)
    if m.kind == "hf_gpt2":
        return hf.gpt2(n_layer=m.n_layers, n_embd=m.dim, n_head=m.n_heads, vocab_size=vocab, seq_len=seq)
    return hf.llama(
        n_layer=m.n_layers,
        hidden=m.dim,
        n_head=m.n_heads,
        n_kv_head=m.n_kv_heads,
        ffn=m.ffn_dim,
        vocab_size=vocab,
        seq_len=seq,
    )


def build_optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    if o.name == "lamb":
        return LAMB(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    if o.name == "lars":
        return LARS(
            params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, trust_coefficient=o.trust_coefficient
        )
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


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


def _fault_rank(step: int) -> None:
    """Fault injection for tests, on the first attempt only (a torchrun restart runs clean):
    TESSERA_FAULT=RANK:STEP kills that rank just before the step; hang:RANK:STEP:SECONDS stalls it."""
    spec = os.environ.get("TESSERA_FAULT", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if spec == f"{dist.get_rank()}:{step}":
        os._exit(13)
    if spec.startswith(f"hang:{dist.get_rank()}:{step}:"):
        time.sleep(float(spec.split(":")[3]))


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time: a peer died, hung or never arrived."""


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def train_step(
    model: nn.Module,
    optimizer: Any,
    booster: tessera.Booster,
    batch: dict,
    grad_clip: float | None,
    step: int,
    timeout_s: float,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Forward, backward, clip, optimizer step; returns (local loss, grad norm, model-state bytes).

    A collective that times out becomes a CollectiveTimeout naming the group and the step.
    """
    try:
        loss = F.cross_entropy(logits_of(model(batch["x"])).float().flatten(0, 1), batch["y"].flatten())
        booster.backward(loss, optimizer)
        grad_norm = booster.clip_grad_norm(model, optimizer, max_norm=grad_clip or math.inf)
        optimizer.step()
        state_bytes = int(tessera.memory.model_state_bytes(model, optimizer))
        optimizer.zero_grad()
        return loss, grad_norm, state_bytes
    except RuntimeError as exc:
        if not _is_timeout(exc):
            raise
        ranks = dist.get_process_group_ranks(booster.mesh.get_group("dp"))
        raise CollectiveTimeout(
            f"step {step}: a collective on the data-parallel group 'dp' (ranks {ranks}) did not complete "
            f"within train.timeout_s={timeout_s:g} s on rank {dist.get_rank()}: another rank died, hung or never "
            "arrived. Check that rank's log; restart with --resume to continue from the last checkpoint."
        ) from None


@torch.no_grad()
def generate(model: nn.Module, prompt: str, n_bytes: int, seq_len: int, device: torch.device) -> str:
    """Sample ``n_bytes`` bytes after ``prompt``; every rank runs it (sharded models need all ranks)."""
    tok = ByteTokenizer()
    tokens = torch.tensor([tok.encode(prompt)], device=device)
    g = torch.Generator(device=device).manual_seed(0)  # same draws on every rank
    # Sequence-parallel modules would expect a slice of the sequence: generate on the whole one.
    sp_modules = [(m, m.sp_group) for m in model.modules() if getattr(m, "sp_group", None) is not None]
    for m, _ in sp_modules:
        m.sp_group = None
    model.eval()
    try:
        for _ in range(n_bytes):
            logits = logits_of(model(tokens[:, -seq_len:]))[:, -1].float()
            probs = torch.softmax(logits / 0.8, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], dim=1)
    finally:
        model.train()
        for m, group in sp_modules:
            m.sp_group = group
    return tok.decode(tokens[0].tolist())


def train(cfg: Config) -> dict[str, Any]:
    """Train as ``cfg`` says; return a summary (first/last loss, steps, paths) on every rank."""
    tessera.init(timeout_s=cfg.train.timeout_s)
    torch.manual_seed(cfg.train.seed)
    booster = tessera.Booster(plan_from_config(cfg.plan))
    rank0 = dist.get_rank() == 0
    dataset = PackedText(resolve_paths(cfg.data.paths), cfg.data.seq_len, cfg.data.max_bytes)
    model = build_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = booster.boost(model, build_optimizer(cfg, model.parameters()))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    loader = booster.dataloader(dataset, cfg.train.global_batch_size, seed=cfg.train.seed)
    run_dir, ckpt_root = cfg.run_dir, cfg.run_dir / "checkpoints"

    step, epoch, batch_in_epoch = 0, 0, 0
    resumed_from = latest_checkpoint(ckpt_root) if cfg.checkpoint.resume == "auto" else None
    if resumed_from is not None:
        state = load_checkpoint(resumed_from, model, optimizer)
        step, epoch, batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        schedule.load_state_dict(state["scheduler"])
        if booster.scaler is not None and state.get("scaler"):
            booster.scaler.load_state_dict(state["scaler"])
        if rank0:
            print(f"resumed from {resumed_from} at step {step}", flush=True)

    def trainer_state() -> dict[str, Any]:
        return {
            "step": step,
            "epoch": epoch,
            "batch_in_epoch": batch_in_epoch,
            "scheduler": schedule.state_dict(),
            "scaler": booster.scaler.state_dict() if booster.scaler else None,
        }

    def checkpoint() -> None:
        save_checkpoint(
            ckpt_root,
            step,
            model,
            optimizer,
            trainer_state(),
            cfg.checkpoint.keep,
            {"plan": booster.plan.to_dict(), "config": cfg.model_dump(mode="json")},
        )

    job_peak = job_peak_tflops(cfg.train.peak_tflops, booster.device)  # may refuse: before any file is written
    log = MetricsLog(run_dir, cfg.logging.tensorboard, step if resumed_from else None) if rank0 else None
    progress = Progress(cfg.train.steps, enabled=rank0 and cfg.logging.progress)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    hf_cfg = getattr(data_parallel_unwrap(model), "config", None)  # a model built from a config file knows its sizes
    n_layers = getattr(hf_cfg, "num_hidden_layers", cfg.model.n_layers)
    dim = getattr(hf_cfg, "hidden_size", cfg.model.dim)
    flops_per_token = transformer_flops_per_token(n_params, n_layers, dim, cfg.data.seq_len)
    losses: list[float] = []
    start_step, start_time = step, time.perf_counter()
    last_step = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
    while step < last_step:
        loader.set_epoch(epoch, batch_in_epoch)
        for batch in loader:
            _fault_rank(step + 1)
            t0 = time.perf_counter()
            loss, grad_norm, state_bytes = train_step(
                model, optimizer, booster, batch, cfg.optimizer.grad_clip, step + 1, cfg.train.timeout_s
            )
            lr = schedule.get_last_lr()[0]
            schedule.step()
            global_loss = booster.reduce_loss(loss).item()
            step, batch_in_epoch = step + 1, batch_in_epoch + 1
            losses.append(global_loss)
            step_time = time.perf_counter() - t0
            log_now = step % cfg.train.log_every == 0 or step in (start_step + 1, last_step)
            if log_now:
                per_rank_bytes = [0] * dist.get_world_size()
                dist.all_gather_object(per_rank_bytes, state_bytes)  # every rank joins; rank 0 logs
            if rank0 and log_now:
                elapsed = time.perf_counter() - start_time
                tok_s = (step - start_step) * tokens_per_step / elapsed
                record = {
                    "step": step,
                    "loss": global_loss,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tok_s,
                    "step_time_s": step_time,
                    "achieved_tflops": tok_s * flops_per_token / 1e12,
                    "model_state_bytes_rank0": state_bytes,
                    "model_state_bytes_per_rank": per_rank_bytes,
                    "epoch": epoch,
                }
                if job_peak:
                    record["mfu"] = record["achieved_tflops"] / job_peak
                log.log(record)
                progress.update(step, global_loss, tok_s, elapsed, step - start_step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                checkpoint()
            if step == last_step:
                break
        else:
            epoch, batch_in_epoch = epoch + 1, 0
    progress.close()
    if not cfg.checkpoint.every or step % cfg.checkpoint.every:
        checkpoint()
    sample = (
        generate(model, "def ", cfg.train.sample_bytes, cfg.data.seq_len, booster.device)
        if cfg.train.sample_bytes
        else ""
    )
    summary = {
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "steps": step,
        "run_dir": str(run_dir),
        "resumed_from": str(resumed_from) if resumed_from else None,
    }
    if rank0:
        log.close()
        plot_loss(
            log.path,
            run_dir / "loss.png",
            f"{cfg.logging.run_name}: {n_params / 1e6:.2f}M params, "
            f"plan zero={booster.plan.zero}, {dist.get_world_size()} ranks",
        )
        if losses:
            print(
                f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps {start_step + 1}-{step}; "
                f"metrics: {log.path}; plot: {run_dir / 'loss.png'}",
                flush=True,
            )
        if sample:
            print("sample:\n" + sample, flush=True)
    return summary
