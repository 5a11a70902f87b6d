"""Train-issue acceptance 5: LAMB and LARS under sharding equal single-process LAMB/LARS."""

from __future__ import annotations

import functools

import pytest
import torch
from parity import GLOBAL_BATCH_DEFAULT, TokenData, build_model, global_batches, loss_fn, plain_loop_losses, run_shared

import tessera
from tessera.optim.lamb import LAMB
from tessera.optim.lars import LARS

STEPS = 3
OPTIMIZERS = {
    "lamb": lambda params: LAMB(params, lr=1e-2, weight_decay=0.01),
    "lars": lambda params: LARS(params, lr=0.5, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.02),
}


def test_lamb_first_step_matches_the_formula() -> None:
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))  # ‖w‖ = 5
    w.grad = torch.tensor([1.0, -2.0])
    LAMB([w], lr=0.1, eps=0.0, weight_decay=0.0).step()
    u = torch.tensor([1.0, -1.0])  # m̂/√v̂ = sign(g) on the first step
    torch.testing.assert_close(w.detach(), torch.tensor([3.0, 4.0]) - 0.1 * (5 / u.norm()) * u)


def test_lars_first_step_matches_the_formula() -> None:
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    w.grad = torch.tensor([0.6, 0.8])  # ‖g‖ = 1
    LARS([w], lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=0.01).step()
    torch.testing.assert_close(w.detach(), torch.tensor([3.0, 4.0]) - 0.1 * 0.01 * 5 * torch.tensor([0.6, 0.8]))


@functools.cache
def reference(name: str) -> dict:
    model = build_model("llama")
    opt = OPTIMIZERS[name](model.parameters())
    losses = []
    for x, y in global_batches(TokenData(), GLOBAL_BATCH_DEFAULT, STEPS):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def sharded_worker(name: str, plan_dict: dict) -> dict:
    import torch.distributed as dist

    model = build_model("llama")
    booster = tessera.Booster(tessera.Plan.from_dict(plan_dict))
    model, opt = booster.boost(model, OPTIMIZERS[name](model.parameters()))
    losses = plain_loop_losses(booster, model, opt, GLOBAL_BATCH_DEFAULT, STEPS)
    state = booster.full_state_dict(model)
    return {"losses": losses, "params": state if dist.get_rank() == 0 else None}


LAYOUTS = {
    "zero3x2": (tessera.ZeRO(stage=3), 2),
    "zero3x4": (tessera.ZeRO(stage=3), 4),
    "zero1x2": (tessera.ZeRO(stage=1), 2),
    "zero3-shares3-1": (tessera.ZeRO(stage=3, dp_shares=(3, 1)), 2),
    "zero1-dp2xtp2": (tessera.Hybrid(tp=2, zero=1), 4),  # pieces of tp shards: norms summed over dp and tp
}


@pytest.fixture(scope="module")
def results() -> dict:
    """Every (optimizer, layout) case, one launch per world size (spawning ranks costs more than a case)."""
    out = {}
    for world in sorted({w for _, w in LAYOUTS.values()}):
        calls = {
            f"{name}-{layout}": (sharded_worker, (name, plan.to_dict()))
            for layout, (plan, w) in LAYOUTS.items()
            if w == world
            for name in OPTIMIZERS
        }
        out.update(run_shared(world, calls))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_sharded_layerwise_optimizer_equals_single_process(name: str, layout: str, results: dict) -> None:
    got = results[f"{name}-{layout}"][0]
    want = reference(name)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-5)
    for k, v in want["params"].items():
        torch.testing.assert_close(got["params"][k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
