"""FP8 training through torchao (issue 34, item 2; Plan.precision="fp8"), on CPU through torchao's emulation
(Plan.fp8_emulate: float8 casts and scales, bf16 matmuls: the numerics of FP8 training, not its speed).

Tolerance: FP8 training is not bf16 training, so no layout equals another to 1e-5; what holds is that it
trains like bf16. Every FP8 layout's loss stays within 0.02 of plain PyTorch bf16 training (one process,
autocast) at each of 50 steps, while the loss falls by more than 1.5: e4m3 keeps 3 mantissa bits, and on
these models the runs measured 0.004 to 0.008 apart from bf16 over 60 steps (bf16 from fp32: 0.001). That the
blocks' linears really are float8 (and the head and embeddings not) is checked on the laid-out model, so a
run that silently stayed bf16 fails too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parity import SEQ, VOCAB, build_model, make_optimizer

import tessera
from tessera.errors import NotSupportedYet, PlanError

STEPS = 50
GLOBAL_BATCH = 8
LR = 3e-3
TOLERANCE = 0.02
BLOCK_LINEARS = 14  # 2 blocks x (wq, wk, wv, wo, w1, w2, w3)
FP8 = {
    "ddp": tessera.Plan(precision="fp8", fp8_emulate=True),
    "zero3": tessera.Plan(precision="fp8", fp8_emulate=True, zero=3),  # weights all-gathered in float8
    "tp2 rowwise": tessera.Plan(precision="fp8", fp8_emulate=True, tp=2, fp8_recipe="rowwise"),
    "zero3 compiled": tessera.Plan(precision="fp8", fp8_emulate=True, zero=3, compile="blocks"),
}


def patterned(n: int, seed: int = 1) -> torch.Tensor:
    """Sequences that count up by 1, 2 or 3 from a random start (mod the vocabulary): learnable in a few
    dozen steps, so a run that trains worse than bf16 shows."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def _loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def bf16_reference() -> list[float]:
    """Plain PyTorch, one process: bf16 autocast over fp32 weights, AdamW."""
    model = build_model("llama")
    opt = make_optimizer(model.parameters(), LR)
    data, losses = patterned(STEPS * GLOBAL_BATCH), []
    for step in range(STEPS):
        batch = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model(batch[:, :-1]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fp8_worker(plans: dict[str, dict], folder: str) -> dict[str, dict]:
    """Each plan trained for STEPS steps (each dp rank its slice of every global batch): its losses and what
    its laid-out model holds; and the ZeRO-3 run's checkpoint (float8-gathered weights) loaded into a bf16
    ZeRO-2 layout, as its ``reloaded`` largest weight difference."""
    from tessera.checkpoint import load_checkpoint, save_checkpoint
    from tessera.memory import model_state_bytes
    from tessera.parallel.data_parallel import unwrap

    rank, out = torch.distributed.get_rank(), {}
    for name, plan_dict in plans.items():
        booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
        model = build_model("llama")
        model, opt = booster.boost(model, make_optimizer(model.parameters(), LR))
        data, losses = patterned(STEPS * GLOBAL_BATCH), []
        dp, coords = booster.plan.dp or 1, booster.plan.coords(rank)
        for step in range(STEPS):
            batch = data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH].chunk(dp)[coords.dp]
            loss = _loss(model(batch[:, :-1]), batch)
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(float(booster.reduce_loss(loss)))
        counted = model_state_bytes(model, opt).params  # (float8-gathered weights wrap their fp32 shards)
        out[name] = {"losses": losses, **_inspect(unwrap(model)), "param_bytes": (counted, _param_bytes(model))}
        if name == "zero3":
            path = save_checkpoint(folder, STEPS, model, opt, {"step": STEPS}, keep=1, meta={"run_id": "fp8"})
            other = build_model("llama")
            other_booster = tessera.Booster(tessera.Plan(precision="bf16", zero=2))
            other, other_opt = other_booster.boost(other, make_optimizer(other.parameters(), LR))
            load_checkpoint(path, other, other_opt)
            saved, loaded = booster.full_state_dict(model), other_booster.full_state_dict(other)
            if rank == 0:
                out[name]["reloaded"] = max(float((saved[k] - loaded[k]).abs().max()) for k in saved)
    return out


def _param_bytes(model: torch.nn.Module) -> int:
    """fp32 bytes of this rank's share of every parameter."""
    from torch.distributed.tensor import DTensor

    return sum(4 * (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _inspect(model: torch.nn.Module) -> dict:
    """Which linears are float8, and whether FSDP2 holds their weights as float8-gathered tensors."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    float8 = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    weights = [m.weight for m in model.modules() if isinstance(m, Float8Linear)]
    local = [w.to_local() if isinstance(w, DTensor) else w for w in weights]
    return {
        "float8": float8,
        "float8_gathered": sum(isinstance(w, WeightWithDynamicFloat8CastTensor) for w in local),
    }


def test_fp8_trains_like_bf16_in_ddp_zero3_tp2_and_compiled(tmp_path) -> None:
    """One launch of 2 ranks: each FP8 layout tracks plain bf16 training (see the module's tolerance), with
    every block linear in float8 and nothing else; ZeRO-3 tensorwise gathers its block weights in float8,
    and its checkpoint loads, weight for weight, into a layout without FP8 (bf16 ZeRO-2)."""
    from tessera.testing import run_ranks

    plans = {name: plan.to_dict() for name, plan in FP8.items()}
    results = run_ranks(fp8_worker, 2, plans, str(tmp_path), timeout_s=600)[0]
    bf16 = bf16_reference()
    assert bf16[0] - bf16[-1] > 1.5, f"the reference did not learn: {bf16[0]:.3f} -> {bf16[-1]:.3f}"
    for name, run in results.items():
        apart = max(abs(a - b) for a, b in zip(run["losses"], bf16))
        assert len(run["losses"]) == STEPS and apart <= TOLERANCE, f"fp8 {name}: {apart:.4f} from bf16"
        assert len(run["float8"]) == BLOCK_LINEARS, f"fp8 {name}: float8 linears {run['float8']}"
        assert all(n.startswith("layers.") for n in run["float8"]), f"fp8 {name}: {run['float8']}"
        assert run["param_bytes"][0] == run["param_bytes"][1], f"fp8 {name}: parameter bytes counted"
    assert results["zero3"]["float8_gathered"] == BLOCK_LINEARS, "ZeRO-3 tensorwise gathers bf16 weights"
    assert results["zero3"]["reloaded"] == 0.0
    # plain tensors on disk: a checkpoint naming torchao's classes could not be read where torchao is not
    # imported (a reader of data alone refuses unknown classes; this worker imported torchao, so allowed them)
    shards = list(tmp_path.rglob("*.distcp"))
    assert shards and not any(b"torchao" in shard.read_bytes() for shard in shards)
    assert results["tp2 rowwise"]["float8_gathered"] == 0  # (rowwise scales cannot be gathered in float8)


def test_fp8_is_refused_where_it_cannot_run() -> None:
    """Before any group or model: no float8 matmul and no emulation asked (named with the way out); fp8
    fields without fp8; layouts FP8 does not compose with yet."""
    from tessera.parallel.float8 import fp8_problem
    from tessera.runtime.hooks import Hooks
    from tessera.runtime.parallelize import parallelize

    problem = fp8_problem(torch.device("cpu"), emulate=False)
    assert problem is not None and "CPU" in problem and "fp8_emulate: true" in problem, problem
    assert fp8_problem(torch.device("cpu"), emulate=True) is None
    with pytest.raises(PlanError, match="fp8_recipe and Plan.fp8_emulate apply to precision 'fp8'"):
        tessera.Plan(precision="bf16", fp8_recipe="rowwise")
    with pytest.raises(PlanError, match="fp8_recipe='blockwise' is not one of tensorwise, rowwise"):
        tessera.Plan(precision="fp8", fp8_recipe="blockwise")
    with pytest.raises(NotSupportedYet, match="precision='fp8' with Plan.pp=2"):
        tessera.Plan(precision="fp8", fp8_emulate=True, pp=2, pipeline={"microbatches": 2}).resolve(2)
    with pytest.raises(PlanError, match="needs float8 matmuls"):  # the runtime's own check, as a rank lays out
        parallelize(build_model("llama"), tessera.Plan(precision="fp8"), None, None, Hooks(), torch.device("cpu"))


def test_fp8_without_torchao_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from tessera.parallel.float8 import fp8_problem

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # an import of it now fails
    problem = fp8_problem(torch.device("cpu"), emulate=True)
    assert problem is not None and "pip install 'tessera[fp8]'" in problem, problem


def test_the_planner_plans_fp8_only_on_devices_with_an_fp8_figure() -> None:
    """Hopper's catalogue entry has FP8 (twice its bf16 peak): an FP8 plan is predicted faster than bf16 there;
    an A100, without FP8 tensor cores, is refused by name."""
    from tessera.cluster import Cluster
    from tessera.models import Llama, LlamaConfig
    from tessera.planner import plan_for

    with torch.device("meta"):
        model = Llama(LlamaConfig(vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=4096,
                                  max_seq_len=2048))  # fmt: skip

    def best(device_type: str, precision: str):
        cluster = Cluster.from_dict({"nodes": [{"name": "a", "devices": [{"type": device_type, "count": 4}]}]})
        return plan_for(cluster, model, 32, precision=precision, top=1)[0]

    fp8, bf16 = best("H100", "fp8"), best("H100", "bf16")
    assert fp8.plan.precision == "fp8" and fp8.estimate.step_s < bf16.estimate.step_s
    with pytest.raises(PlanError, match="A100-80GB has no fp8 figure"):
        best("A100-80GB", "fp8")
