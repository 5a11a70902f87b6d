"""Hybrid-issue acceptance 1, 2, 6 (tp parts) and 9 (tp plan errors): tensor parallelism equals dense."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import GLOBAL_BATCH_DEFAULT, build_model, check_cases, run_shared
from torch import nn

import tessera


def linear_worker(style: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    dense = nn.Linear(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    probe = torch.randn(4, 32)
    sharded = nn.Linear(16, 32)
    sharded.load_state_dict(dense.state_dict())
    mesh = init_device_mesh("cpu", (2,))
    plan = (
        ColwiseParallel(use_local_output=False)
        if style == "colwise"
        else RowwiseParallel(input_layouts=Replicate(), use_local_output=False)
    )
    parallelize_module(sharded, mesh, plan)
    xs = x.detach().clone().requires_grad_(True)
    out = sharded(xs).full_tensor()
    (out * probe).sum().backward()
    (dense(x) * probe).sum().backward()
    return {
        "out": (out.detach(), dense(x).detach()),
        "x_grad": (xs.grad, x.grad),
        "w_grad": (sharded.weight.grad.full_tensor(), dense.weight.grad),
        "b_grad": (sharded.bias.grad.full_tensor(), dense.bias.grad),
    }


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_parallel_linear_equals_dense(style: str, two_ranks: dict) -> None:
    for rank_result in two_ranks[f"linear-{style}"]:
        for name, (got, want) in rank_result.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{style} {n}: {m}")


def vocab_parallel_worker() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    torch.manual_seed(0)
    dense = nn.ModuleDict({"emb": nn.Embedding(64, 16), "head": nn.Linear(16, 64, bias=False)})
    sharded = nn.ModuleDict({"emb": nn.Embedding(64, 16), "head": nn.Linear(16, 64, bias=False)})
    sharded.load_state_dict(dense.state_dict())
    tokens = torch.randint(0, 64, (3, 8))
    target = torch.randint(0, 64, (3, 8))
    target[0, :3] = -100  # ignored positions
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(
        sharded,
        mesh,
        {
            "emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    logits = sharded["head"](sharded["emb"](tokens))
    (placement,) = logits.placements
    assert placement.is_shard(logits.ndim - 1) or placement == Shard(-1), placement  # logits never gathered
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100)
        loss.backward()
    ref = F.cross_entropy(dense["head"](dense["emb"](tokens)).flatten(0, 1), target.flatten(), ignore_index=-100)
    ref.backward()
    return {
        "loss": (loss.full_tensor().detach(), ref.detach()),
        "emb_grad": (sharded["emb"].weight.grad.full_tensor(), dense["emb"].weight.grad),
        "head_grad": (sharded["head"].weight.grad.full_tensor(), dense["head"].weight.grad),
    }


def test_vocab_parallel_embedding_and_cross_entropy_equal_dense(two_ranks: dict) -> None:
    for rank_result in two_ranks["vocab"]:
        for name, (got, want) in rank_result.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


TP2 = tessera.Hybrid(tp=2).to_dict()
KINDS = ("llama", "hf_llama", "hf_qwen2")


LOSS_PARALLEL = tessera.Hybrid(tp=2, loss_parallel=True)


def test_tp2_training_equals_single_process() -> None:
    """Acceptance 6, tp2, for the reference Llama and each Hugging Face family with a policy; also
    with the cross-entropy computed on vocabulary shards (Plan.loss_parallel)."""
    cases = [(f"{kind} tp2", TP2, kind, None) for kind in (*KINDS, "gpt2", "llama_tied")]
    cases += [(f"{kind} tp2 loss_parallel", LOSS_PARALLEL.to_dict(), kind, None) for kind in (*KINDS, "gpt2")]
    check_cases(2, cases, GLOBAL_BATCH_DEFAULT, 3)


LOGITS_KINDS = ("llama", "hf_llama")


def logits_layout_worker(kind: str) -> str:
    from parity import SEQ

    booster = tessera.Booster(LOSS_PARALLEL)
    model, _ = booster.boost(build_model(kind))
    output = model(torch.zeros(2, SEQ, dtype=torch.long))
    logits = getattr(output, "logits", output)
    return f"{type(logits).__name__} {logits.placements} local {tuple(logits.to_local().shape)}"


@pytest.mark.parametrize("kind", LOGITS_KINDS)
def test_loss_parallel_never_gathers_the_logits(kind: str, two_ranks: dict) -> None:
    from parity import SEQ, VOCAB

    got = two_ranks[f"logits-{kind}"][0]
    assert got == f"DTensor (Shard(dim=2),) local (2, {SEQ}, {VOCAB // 2})", got


def test_dp2_tp2_with_every_zero_stage_equals_single_process() -> None:
    """Acceptance 6, dp2×tp2 with DDP and ZeRO-1/2/3 (and uneven shares), on one 4-rank group."""
    cases = [
        (f"{kind} dp2xtp2 zero{zero}", tessera.Hybrid(tp=2, zero=zero).to_dict(), kind, None)
        for kind in (*KINDS, "gpt2")
        for zero in (0, 1, 2, 3)
    ]
    cases.append(
        ("llama dp2xtp2 zero3 shares 3:1", tessera.Hybrid(tp=2, zero=3, dp_shares=(3, 1)).to_dict(), "llama", None)
    )
    cases.append(
        ("llama dp2xtp2 zero1 shares 3:1", tessera.Hybrid(tp=2, zero=1, dp_shares=(3, 1)).to_dict(), "llama", None)
    )
    loss_parallel = tessera.Hybrid(tp=2, zero=3, loss_parallel=True).to_dict()
    cases.append(("hf_llama dp2xtp2 zero3 loss_parallel", loss_parallel, "hf_llama", None))
    check_cases(4, cases, GLOBAL_BATCH_DEFAULT, 3)


def bad_tp_worker(plan_dict: dict) -> str:
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
    try:
        booster.boost(nn.Sequential(nn.Linear(4, 4)))
    except tessera.PlanError as exc:
        return str(exc)
    return "no error"


def test_tp_that_does_not_divide_heads_is_refused() -> None:
    from tessera.models import Llama, LlamaConfig
    from tessera.models.policies import policy_for

    model = Llama(LlamaConfig(vocab_size=64, dim=48, n_layers=1, n_heads=6, n_kv_heads=3, ffn_dim=64))
    with pytest.raises(tessera.PlanError, match="n_kv_heads=3"):
        policy_for(model).check_tp(model, 2)


def test_model_without_a_policy_names_the_policies(two_ranks: dict) -> None:
    message = two_ranks["no-policy"][0]
    assert "no policy for Sequential" in message and "Hugging Face GPT-2" in message, message


def dropout_worker(plan_dict: dict) -> list[str]:
    """Train GPT-2 with dropout under tp; return the replicated parameters that differ across tp ranks."""
    import torch.distributed as dist
    from parity import SEQ, VOCAB, TokenData, loss_fn, make_optimizer
    from torch.distributed.tensor import DTensor

    from tessera.models import hf

    torch.manual_seed(0)  # the same stream on every rank, as a training script seeds it
    model = hf.gpt2(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, seq_len=SEQ, dropout=0.2)
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
    model, opt = booster.boost(model, make_optimizer(model.parameters()))
    model.train()
    for step, batch in enumerate(booster.dataloader(TokenData(), global_batch_size=GLOBAL_BATCH_DEFAULT)):
        if step == 3:
            break
        booster.execute_pipeline(batch, model, loss_fn, opt)
        opt.step()
        opt.zero_grad()
    drifted = []
    group = booster.mesh.get_group("tp")
    for name, p in model.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements) else None
        if t is None and isinstance(p, DTensor):
            continue  # sharded over tp: each rank holds different elements by design
        t = (t if t is not None else p).detach().contiguous()
        copies = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, t, group=group)
        if not all(torch.equal(c, copies[0]) for c in copies):
            drifted.append(name)
    return drifted


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-split_gather"])
def test_dropout_keeps_replicated_parameters_identical_across_tp_ranks(sp: bool, two_ranks: dict) -> None:
    """With dropout on, every tp rank must drop the same elements of replicated activations, or
    the replicated parameters (norms, biases, positions) silently drift apart between ranks."""
    assert two_ranks[f"dropout-sp{sp}"][0] == []


SHARD_KINDS = {"llama": ("layers.", 7), "hf_llama": ("model.layers.", 7), "gpt2": ("transformer.h.", 4)}


def shards_worker(kind: str) -> dict:
    """Every weight matrix inside the blocks: its placement and local shape against the full one."""
    from torch.distributed.tensor import DTensor

    model, _ = tessera.Booster(tessera.Hybrid(tp=2)).boost(build_model(kind))
    prefix = SHARD_KINDS[kind][0]
    found = {}
    for name, p in model.named_parameters():
        if name.startswith(prefix) and p.ndim == 2:
            local = p.to_local() if isinstance(p, DTensor) else p
            found[name] = (str(getattr(p, "placements", "not a DTensor")), tuple(local.shape), tuple(p.shape))
    return found


@pytest.mark.parametrize("kind", list(SHARD_KINDS))
def test_tensor_parallel_shards_every_blocks_weights(kind: str, two_ranks: dict) -> None:
    """Parity alone would pass with every weight replicated: each matrix of every block must be split
    in two along one dimension (local shape = full / tp)."""
    found = two_ranks[f"shards-{kind}"][0]
    n_layers = 2
    assert len(found) == SHARD_KINDS[kind][1] * n_layers, sorted(found)
    for name, (placements, local, full) in found.items():
        assert "Shard" in placements, f"{name} is not sharded: {placements}"
        halved = [d for d in range(2) if local[d] * 2 == full[d] and local[1 - d] == full[1 - d]]
        assert len(halved) == 1, f"{name}: local {local} is not the full {full} split in two along one dimension"


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    """The small 2-rank checks of this file, in one launch (spawning ranks costs more than a check)."""
    calls = {f"linear-{style}": (linear_worker, (style,)) for style in ("colwise", "rowwise")}
    calls["vocab"] = (vocab_parallel_worker, ())
    calls.update({f"logits-{kind}": (logits_layout_worker, (kind,)) for kind in LOGITS_KINDS})
    calls["no-policy"] = (bad_tp_worker, (tessera.Hybrid(tp=2).to_dict(),))
    calls.update({f"shards-{kind}": (shards_worker, (kind,)) for kind in SHARD_KINDS})
    for sp in (False, True):
        calls[f"dropout-sp{sp}"] = (dropout_worker, (tessera.Hybrid(tp=2, sp="split_gather" if sp else 1).to_dict(),))
    return run_shared(2, calls)
