"""Shared pieces of the parity tests: tiny models, data, a plain single-process reference.

The reference uses plain PyTorch only (no Tessera), so a Tessera layout that
changes the numbers cannot hide behind a Tessera reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from tessera.models import hf
from tessera.plan import V_SCHEDULES

SEQ = 16
VOCAB = 128
GLOBAL_BATCH_DEFAULT = 8


def make_optimizer(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW for every parity run. eps=1e-6, not 1e-8: a parameter whose true gradient is
    zero (GPT-2's attention key bias) otherwise gets updates of normalised rounding noise,
    which no layout can reproduce bit-for-bit."""
    return torch.optim.AdamW(params, lr=lr, eps=1e-6)


class TokenData(Dataset):
    """Random token sequences; target is the next token."""

    def __init__(self, n: int = 64, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.tokens[i, :-1], "y": self.tokens[i, 1:]}


PRETRAINED = "pretrained="  # a kind naming a save_pretrained directory: "pretrained=/tmp/x"


def build_model(kind: str, seed: int = 0) -> nn.Module:
    """A tiny model of ``kind``: 2 layers, or as many as a suffix says ("llama:8", "hf_qwen2:4"); for
    "pretrained=DIR", transformers' own ``from_pretrained`` (the plain reference for Tessera's loading)."""
    if kind.startswith(PRETRAINED):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(kind.removeprefix(PRETRAINED))
    torch.manual_seed(seed)
    kind, _, layers = kind.partition(":")
    n_layers = int(layers or 2)
    if kind in ("llama", "llama_tied"):
        from tessera.models import Llama, LlamaConfig

        cfg = LlamaConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=n_layers,
            n_heads=4,
            n_kv_heads=2,
            ffn_dim=64,
            max_seq_len=SEQ,
            tie_embeddings=kind == "llama_tied",
        )
        return Llama(cfg)
    if kind in ("moe_llama", "moe_llama_unbalanced"):  # 4 experts, top-2, a shared expert, the balance loss on
        from tessera.models import Llama, LlamaConfig
        from tessera.models.moe import MoESpec

        # unbalanced: no balance loss, which is each micro-batch's, so layouts with several train alike too
        aux = 0.01 if kind == "moe_llama" else 0.0
        moe = MoESpec(experts=4, top_k=2, shared_expert=True, aux_loss_weight=aux)
        cfg = LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=32,
                          max_seq_len=SEQ, moe=moe)  # fmt: skip
        return Llama(cfg)
    if kind == "gpt2":
        return hf.gpt2(n_layer=n_layers, n_embd=32, n_head=4, vocab_size=VOCAB, seq_len=SEQ)
    if kind == "hf_llama":
        return hf.llama(n_layer=n_layers, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=VOCAB, seq_len=SEQ)
    if kind == "lora":  # the Hugging Face Llama with peft's LoRA adapters on column- and row-parallel projections
        from peft import LoraConfig, get_peft_model

        base = hf.llama(n_layer=n_layers, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=VOCAB, seq_len=SEQ)
        targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights="gaussian")
        # (init "gaussian": B random too, so the adapters change the loss from the first step)
        return get_peft_model(base, lora)
    if kind in ("hf_mixtral", "hf_qwen2_moe"):  # 4 experts, top-2; Qwen2-MoE: a shared expert, layer 0 dense
        import transformers

        sizes = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n_layers, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=SEQ, num_experts_per_tok=2)  # fmt: skip
        if kind == "hf_mixtral":
            config = transformers.MixtralConfig(**sizes, intermediate_size=32, num_local_experts=4)
            return transformers.MixtralForCausalLM(config)
        config = transformers.Qwen2MoeConfig(**sizes, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                             shared_expert_intermediate_size=32, mlp_only_layers=[0])  # fmt: skip
        return transformers.Qwen2MoeForCausalLM(config)
    if kind == "hf_qwen2":
        return hf.qwen2(n_layer=n_layers, hidden=32, n_head=4, n_kv_head=2, ffn=64, vocab_size=VOCAB, seq_len=SEQ)
    raise ValueError(kind)


def loss_fn(output, y: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def global_batches(dataset: TokenData, global_batch: int, steps: int, seed: int = 0):
    """The global batches a single process sees (same shuffle rule as the sharded loader)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    for b in range(steps):
        idx = order[b * global_batch : (b + 1) * global_batch]
        yield dataset.tokens[idx, :-1], dataset.tokens[idx, 1:]


def reference_run(kind: str, global_batch: int, steps: int, lr: float = 1e-3, max_norm: float | None = None):
    """Plain single-process AdamW training: losses, grad norms and final parameters."""
    model = build_model(kind)
    opt = make_optimizer(model.parameters(), lr)
    losses, norms, grads = [], [], {}
    for x, y in global_batches(TokenData(), global_batch, steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        if not grads:  # the first step's gradients, before clipping
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)
                     if p.requires_grad}  # fmt: skip
        # max_norm=inf records the global norm without clipping: Adam hides a uniformly
        # mis-scaled gradient, the norm does not.
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # the trained model's loss on the first global batch, forward only
        x, y = next(global_batches(TokenData(), global_batch, 1))
        evaluated = loss_fn(model(x), y).item()
    return {"losses": losses, "norms": norms, "params": params, "grads": grads, "eval": evaluated}


def tessera_run(
    plan_dict: dict,
    kind: str,
    global_batch: int,
    steps: int,
    lr: float = 1e-3,
    max_norm: float | None = None,
    evaluate: bool = True,
):
    """The same training through Tessera on the current ranks (call inside run_ranks); ``evaluate``: also a
    forward-only pass (a compiled run compiles one more graph for it).

    Pipeline and replica plans train through ``booster.execute_pipeline``; the others through the user's own
    forward/backward loop. The first step's full gradients come back too (rank 0)."""
    import torch.distributed as dist

    import tessera

    if kind.startswith(PRETRAINED):  # Tessera's own loading: parameters on meta, each rank reads its slices
        from tessera.models.pretrained import empty_pretrained

        model = empty_pretrained(kind.removeprefix(PRETRAINED))
    else:
        model = build_model(kind)
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
    model, opt = booster.boost(model, make_optimizer(model.parameters(), lr))
    loader = booster.dataloader(TokenData(), global_batch_size=global_batch, seed=0)
    losses, norms, grads = [], [], {}
    for step, batch in enumerate(loader):
        if step == steps:
            break
        if booster.plan.pp > 1 or booster.plan.replicas is not None:
            loss = booster.execute_pipeline(batch, model, loss_fn, opt)
        else:
            with booster.loss_parallel():
                loss = loss_fn(model(batch["x"]), batch["y"])
            booster.backward(loss, opt)
        if step == 0:
            grads = full_grads(booster, model)
        norms.append(float(booster.clip_grad_norm(model, opt, max_norm=max_norm or float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(booster.reduce_loss(loss)))
    state = booster.full_state_dict(model)
    first = next(iter(booster.dataloader(TokenData(), global_batch_size=global_batch, seed=0)))
    evaluated = None  # forward only, every layout but torch's V schedules (refused: test_eval)
    if evaluate and not (booster.plan.pipelined and booster.plan.pipeline.schedule in V_SCHEDULES):
        evaluated = float(booster.reduce_loss(booster.evaluate(first, model, loss_fn)))
    rank0 = dist.get_rank() == 0
    return {"losses": losses, "norms": norms, "params": state if rank0 else None, "grads": grads if rank0 else None,
            "eval": evaluated}  # fmt: skip


def plain_loop_losses(booster, model: nn.Module, opt, global_batch: int, steps: int) -> list[float]:
    """The user's own loop through ``booster`` over ``steps`` global batches of TokenData (seed 0): forward,
    backward, step; the mean loss over each global batch."""
    losses = []
    for step, batch in enumerate(booster.dataloader(TokenData(), global_batch_size=global_batch, seed=0)):
        if step == steps:
            break
        loss = loss_fn(model(batch["x"]), batch["y"])
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(float(booster.reduce_loss(loss)))
    return losses


def full_grads(booster, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, keyed like the unsplit model (gathered over every axis)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tessera.parallel.data_parallel import unwrap
    from tessera.parallel.experts import uneven_expert_names, whole_experts

    out = {}
    names = {id(p): name for name, p in unwrap(model).named_parameters()}
    uneven = uneven_expert_names(unwrap(model), names)  # Plan.expert_shares: each rank's experts, gathered
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):  # tied weights under every name
        if not p.requires_grad:  # frozen (LoRA's base weights): no gradient anywhere
            assert p.grad is None, f"{name} is frozen but has a gradient"
            continue
        g = p.grad
        g = whole_experts(g, uneven[name][0]) if name in uneven else g.full_tensor() if isinstance(g, DTensor) else g
        out[name] = g.detach().cpu().clone()
    group = booster.stage_group
    if group is not None:
        parts = [{} for _ in range(dist.get_world_size(group))]
        dist.all_gather_object(parts, out, group=group)
        out = {k: v for part in parts for k, v in part.items()}
    return out


def assert_same_training(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=rtol, atol=atol)
    if got.get("eval") is not None:
        torch.testing.assert_close(torch.tensor(got["eval"]), torch.tensor(want["eval"]), rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=rtol, atol=atol)
    for part in ("params", "grads") if got.get("grads") is not None else ("params",):
        assert got[part].keys() == want[part].keys(), f"{part}: {sorted(got[part])} vs {sorted(want[part])}"
        for k, v in want[part].items():
            torch.testing.assert_close(
                got[part][k], v, rtol=rtol, atol=atol, msg=lambda m, k=k, p=part: f"{p} {k}: {m}"
            )


def cases_worker(cases: list[tuple[str, dict, str, float | None]], global_batch: int, steps: int) -> dict:
    """Run ``(name, plan dict, model kind, max_norm)`` cases one after the other on these ranks
    (spawning ranks costs more than a case); rank 0 returns each case's results by name, with the graphs it
    compiled (``compiled_graphs``: compiled blocks that first run in this launch compile at least one)."""
    from tessera.parallel.compile import compile_counts

    results = {}
    for name, plan, kind, max_norm in cases:
        before = compile_counts()["graphs"]
        results[name] = tessera_run(plan, kind, global_batch, steps, 1e-3, max_norm)
        results[name]["compiled_graphs"] = compile_counts()["graphs"] - before
    return results


def check_cases(world: int, cases: list[tuple[str, dict, str, float | None]], global_batch: int, steps: int) -> dict:
    """Every case equals plain single-process training; the failures are listed together. Returns rank 0's
    results."""
    from tessera.testing import run_ranks

    results = run_ranks(cases_worker, world, cases, global_batch, steps, timeout_s=600)[0]
    compare_cases(results, cases, global_batch, steps)
    return results


def compare_cases(
    results: dict, cases: list[tuple[str, dict, str, float | None]], global_batch: int, steps: int
) -> None:
    """Each case's results (rank 0's, from :func:`cases_worker`) equal plain single-process training."""
    references: dict[tuple, dict] = {}
    failures = []
    for name, _, kind, max_norm in cases:
        key = (kind, max_norm)
        if key not in references:
            references[key] = reference_run(kind, global_batch, steps, max_norm=max_norm)
        try:
            assert_same_training(results[name], references[key])
        except AssertionError as exc:
            failures.append(f"{name}: {str(exc).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def calls_worker(calls: dict[str, tuple[Any, tuple]]) -> dict[str, Any]:
    """Run each named ``(function, args)`` call in turn on these ranks: one launch for many cases
    (spawning ranks costs more than a case). A failing call names its case."""
    out = {}
    for name, (fn, args) in calls.items():
        try:
            out[name] = fn(*args)
        except Exception as exc:
            raise RuntimeError(f"case {name!r} failed: {type(exc).__name__}: {exc}") from exc
    return out


def run_shared(world: int, calls: dict[str, tuple[Any, tuple]]) -> dict[str, list[Any]]:
    """Every rank's result of each named call, all run in one launch of ``world`` ranks."""
    from tessera.testing import run_ranks

    per_rank = run_ranks(calls_worker, world, calls, timeout_s=600)
    return {name: [rank[name] for rank in per_rank] for name in calls}
