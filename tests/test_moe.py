"""Mixture of experts in the reference Llama (issue 16, item 1): token-choice top-k routing with every token
kept, the balance loss and the loss-free bias, and data-parallel, ZeRO and pipeline layouts that train
like one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import build_model, cases_worker, compare_cases, run_shared
from test_data_parallel_parity import PRESETS

import tessera
from tessera.errors import PlanError
from tessera.models import Llama, LlamaConfig
from tessera.models.moe import MoE, MoESpec, after_step


def _layer(**spec: object) -> MoE:
    torch.manual_seed(0)
    layer = MoE(16, 24, MoESpec(**{"experts": 4, "top_k": 2, **spec}))
    for p in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _one_token_at_a_time(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed token by token from its definition (no sorting, no batching)."""
    out = []
    for token in x:
        logits = layer.router.weight @ token
        scores = logits.softmax(-1) if layer.spec.score == "softmax" else logits.sigmoid()
        best = sorted(range(layer.spec.experts), key=lambda e: -float(scores[e] + layer.expert_bias[e]))
        chosen = best[: layer.spec.top_k]
        weights = scores[chosen] / (scores[chosen].sum() if layer.spec.normalize else 1)
        y = sum(
            w * (F.silu(token @ layer.experts.w1[e]) * (token @ layer.experts.w3[e])) @ layer.experts.w2[e]
            for w, e in zip(weights, chosen)
        )  # fmt: skip
        out.append(y + (layer.shared(token) if layer.shared is not None else 0))
    return torch.stack(out)


@pytest.mark.parametrize(
    "spec",
    [{}, {"score": "sigmoid"}, {"shared_expert": True, "top_k": 1}, {"normalize": False, "top_k": 3}],
    ids=["softmax top-2", "sigmoid top-2", "top-1 with a shared expert", "top-3 not normalised"],
)
def test_every_token_goes_through_its_top_k_experts_weighted_by_their_scores(spec: dict) -> None:
    layer = _layer(**spec)
    x = torch.randn(40, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _one_token_at_a_time(layer, x), rtol=1e-5, atol=1e-6)
    assert int(layer.tokens_per_expert.sum()) == 40 * layer.spec.top_k  # dropless: every slot served


@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 16, 0]], ids=["uneven, one expert idle", "one expert only"])
def test_the_grouped_gemm_gives_the_loop_s_values_and_gradients(monkeypatch: pytest.MonkeyPatch, counts: list) -> None:
    """torch's grouped GEMM (F.grouped_mm, on CPU too in torch 2.13) and the loop of products agree in the
    output and in both operands' gradients, experts without rows included; misaligned rows take the loop.
    So does the operator compiled blocks see (``tessera::grouped_matmul``, with its own backward), either way."""
    from tessera.models import moe

    torch.manual_seed(0)
    rows, weights, counts = torch.randn(16, 12), torch.randn(4, 12, 8), torch.tensor(counts)
    upstream = torch.randn(16, 8)
    assert moe.can_group(rows, weights) and not moe.can_group(torch.randn(16, 6), torch.randn(4, 6, 8))
    results = []
    products = (moe.grouped_matmul, torch.ops.tessera.grouped_matmul)
    for grouped, product in [(g, p) for g in (True, False) for p in products]:
        monkeypatch.setattr(moe, "GROUPED", grouped)
        x, w = rows.clone().requires_grad_(), weights.clone().requires_grad_()
        out = product(x, w, counts)
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not results[0][2][1].any()  # the idle expert gets no gradient


def test_the_balance_loss_is_switch_s_and_trains_the_router_through_the_output() -> None:
    layer = _layer(aux_loss_weight=0.5)
    x = torch.randn(40, 16)
    out = layer(x)
    scores = (x @ layer.router.weight.T).softmax(-1)
    chosen = torch.topk(scores, 2, dim=-1).indices
    share = torch.bincount(chosen.flatten(), minlength=4).float() / 80
    want = 4 * (share * scores.mean(0)).sum()
    torch.testing.assert_close(layer.balance_loss, want.detach())
    out.sum().backward()
    with_loss = layer.router.weight.grad.clone()
    layer.zero_grad()
    plain = _layer(aux_loss_weight=0.0)
    (plain(x).sum() + 0.5 * 4 * (share * (x @ plain.router.weight.T).softmax(-1).mean(0)).sum()).backward()
    torch.testing.assert_close(with_loss, plain.router.weight.grad)


def test_the_loss_free_bias_chooses_experts_without_weighting_them_and_moves_toward_balance() -> None:
    layer = _layer(bias_rate=0.1, aux_loss_weight=0.0)
    x = torch.randn(40, 16)
    layer.expert_bias[3] = 10.0  # every token now picks expert 3
    with torch.no_grad():
        out = layer(x)
        torch.testing.assert_close(out, _one_token_at_a_time(layer, x), rtol=1e-5, atol=1e-6)
    assert int(layer.tokens_per_expert[3]) == 40
    after_step(layer)
    assert torch.allclose(layer.expert_bias, torch.tensor([0.1, 0.1, 0.1, 9.9]))  # overloaded: down; others up
    assert layer.routed[3] == 40 and layer.routed.sum() == 80  # the step's slots: every token's 2
    assert not layer.load.any()  # counted afresh until the next step


def test_a_spec_or_layout_experts_cannot_take_is_refused_by_name() -> None:
    with pytest.raises(PlanError, match="moe.top_k=5 must be between 1 and moe.experts=4"):
        MoESpec(experts=4, top_k=5)
    with pytest.raises(PlanError, match="moe.score='relu' must be 'softmax' or 'sigmoid'"):
        MoESpec(experts=4, score="relu")  # type: ignore[arg-type]
    from tessera.models.policies import policy_for
    from tessera.parallel.experts import check_expert_parallel

    model = Llama(LlamaConfig(moe=MoESpec(experts=4)))
    with pytest.raises(PlanError, match="Plan.ep=3 does not divide the MoE layers' 4 experts"):
        check_expert_parallel(3, [model.layers[0].feed_forward.experts])
    with pytest.raises(PlanError, match="Plan.ep=2 splits experts, but the model has no experts Tessera can split"):
        check_expert_parallel(2, [])
    with pytest.raises(PlanError, match=r"Plan.expert_shares=\[3, 2\] sum to 5, but the MoE layers have 4 experts"):
        check_expert_parallel(2, [model.layers[0].feed_forward.experts], (3, 2))
    with pytest.raises(PlanError, match="Plan.expert_shares has 3 entries but Plan.ep=2"):
        tessera.Plan(ep=2, expert_shares=(1, 2, 1))
    with pytest.raises(PlanError, match=r"Plan.expert_shares\[1\]=0: every ep rank holds a positive number"):
        tessera.Plan(ep=2, expert_shares=(4, 0))
    with pytest.raises(tessera.NotSupportedYet, match="Plan.ep=2 with Plan.offload=True is not supported yet"):
        tessera.Plan(ep=2, zero=3, offload=True).resolve(4)
    with pytest.raises(PlanError, match="Plan.ep=4 must divide the data-parallel size dp=2"):
        tessera.Plan(ep=4).resolve(2)
    with pytest.raises(PlanError, match="split/gather sequence parallelism .* Llama with experts .* not supported"):
        policy_for(model).tensor_plan(model, sequence_parallel=True)


def test_tessera_train_refuses_an_ep_the_experts_cannot_take_before_launch(tmp_path: Path) -> None:
    import yaml
    from test_checkpoint import tiny_config
    from transformers import MixtralConfig

    from tessera.config import ConfigError
    from tessera.launch.preflight import check_training

    MixtralConfig(hidden_size=32, num_attention_heads=4, num_local_experts=6).save_pretrained(tmp_path / "mixtral")
    mixtral = {"kind": "hf_config", "hf_config": str(tmp_path / "mixtral")}
    for moe, have in ((None, "no experts"), ({"experts": 6}, "model.moe.experts=6"), (mixtral, "num_local_experts=6")):
        config = tiny_config(tmp_path / "runs", 2, 2, {"preset": "ddp", "ep": 4})
        if moe is mixtral:
            config["model"] = mixtral
        elif moe is not None:
            config["model"]["moe"] = moe
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
        with pytest.raises(ConfigError, match=f"plan.ep=4 splits each MoE layer's experts .* has {have}"):
            check_training(str(tmp_path / "c.yaml"), [], 4, 1, overwrite=True)
    config = tiny_config(tmp_path / "runs", 2, 2, {"preset": "ddp", "ep": 2, "expert_shares": [3, 2]})
    config["model"]["moe"] = {"experts": 4}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"plan.expert_shares=\[3, 2\] sum to 5, but .* model.moe.experts=4"):
        check_training(str(tmp_path / "c.yaml"), [], 2, 1, overwrite=True)


def test_experts_train_like_one_process_under_ddp_zero_pipeline_stages_and_expert_parallelism() -> None:
    """A 2-layer Llama with 4 experts (top-2, a shared expert, balance loss 0.01) on 2 ranks: DDP, ZeRO-1/2/3,
    uneven shares 3:1, pp2, ep2 (each rank 2 experts, tokens exchanged by all-to-all), ep2 under ZeRO-1/3, and
    ep2 with samples 3:1 and experts 3:1 (the first rank takes 3/4 of the batch and holds 3 of the 4 experts)
    and with experts 1:3 under ZeRO-3:
    losses, norms, first gradients and parameters after 3 AdamW steps equal one process (1e-5): the balance
    loss counts the routing of the whole batch (summed over the data ranks) and gets the batch loss's weight.
    Hugging Face's Mixtral and Qwen2-MoE (a shared expert, a dense first layer), built from configs, against
    transformers' own forward on one process: ep2 (Mixtral's experts through Tessera's dispatch), ep2 under
    ZeRO-1 and ZeRO-3, tp2 (attention and dense MLPs split, experts whole), pp2, and Mixtral ep2 with experts
    1:3 under ZeRO-1. ep2 × dp2 on 4 ranks, under
    DDP and ZeRO-3, and tp2 × ep2: test_pretrained's launch.
    Parity does not care where experts sit, so under uneven shares each rank's stacked expert rows are
    compared, exactly, with the rows its share names in the model before boosting."""
    plans = {
        **PRESETS,
        "shares 3:1": tessera.Plan(dp_shares=(3, 1)),
        "pp2": tessera.Plan(pp=2, pipeline={"schedule": "gpipe"}),
        "ep2": tessera.Plan(ep=2),
        "ep2 zero1": tessera.Plan(ep=2, zero=1),
        "ep2 zero3": tessera.Plan(ep=2, zero=3),
        "ep2, samples 3:1, experts 3:1": tessera.Plan(ep=2, dp_shares=(3, 1), expert_shares=(3, 1)),
        "ep2, experts 1:3, zero3": tessera.Plan(ep=2, expert_shares=(1, 3), zero=3),
    }
    cases = [(name, plan.to_dict(), "moe_llama", None) for name, plan in plans.items()]
    hugging_face = {
        "Mixtral ep2": (tessera.Plan(ep=2), "hf_mixtral"),
        "Mixtral ep2 zero3": (tessera.Plan(ep=2, zero=3), "hf_mixtral"),
        "Mixtral tp2": (tessera.Plan(tp=2), "hf_mixtral"),
        "Mixtral pp2": (tessera.Plan(pp=2, pipeline={"schedule": "gpipe"}), "hf_mixtral"),
        "Qwen2-MoE ep2 zero1": (tessera.Plan(ep=2, zero=1), "hf_qwen2_moe"),
        "Qwen2-MoE tp2": (tessera.Plan(tp=2), "hf_qwen2_moe"),
        "Mixtral ep2, experts 1:3, zero1": (tessera.Plan(ep=2, expert_shares=(1, 3), zero=1), "hf_mixtral"),
    }
    cases += [(name, plan.to_dict(), kind, None) for name, (plan, kind) in hugging_face.items()]
    held = {name: (plans[name], "moe_llama") for name in ("ep2, samples 3:1, experts 3:1", "ep2, experts 1:3, zero3")}
    held["Mixtral ep2, experts 1:3, zero1"] = hugging_face["Mixtral ep2, experts 1:3, zero1"]
    calls = {"parity": (cases_worker, (cases, 8, 3))}  # one launch: the held rows ride with the parity cases
    calls |= {name: (held_expert_rows, (plan.to_dict(), kind)) for name, (plan, kind) in held.items()}
    results = run_shared(2, calls)
    compare_cases(results["parity"][0], cases, 8, 3)
    for name, (plan, _) in held.items():
        _assert_each_rank_holds_its_share(name, plan.expert_shares, results[name])


def held_expert_rows(plan: dict, kind: str) -> tuple[list[dict], list[dict]]:
    """Every MoE layer's stacked expert weights, whole before boosting and as this rank holds them after."""
    from torch.distributed.tensor import DTensor

    from tessera.models.hf_experts import expert_modules

    model = build_model(kind)
    units = expert_modules(model)
    whole = [{name: getattr(unit, name).detach().clone() for name in unit.stacked_weights} for unit in units]
    tessera.Booster(tessera.Plan.from_dict(plan)).boost(model, torch.optim.AdamW(model.parameters()))
    held = [{name: getattr(unit, name) for name in unit.stacked_weights} for unit in units]
    held = [{k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in u.items()} for u in held]
    return whole, held


def _assert_each_rank_holds_its_share(case: str, shares: tuple[int, ...], per_rank: list[tuple]) -> None:
    """Rank r (ep rank r: the ep ranks are the first ones) holds experts sum(shares[:r]) onwards, shares[r] of them."""
    assert len(per_rank) == len(shares)
    for rank, (whole, held) in enumerate(per_rank):
        first = sum(shares[:rank])
        assert whole and len(whole) == len(held), case
        for layer, (want, got) in enumerate(zip(whole, held)):
            for name in want:
                torch.testing.assert_close(
                    got[name], want[name][first : first + shares[rank]], rtol=0, atol=0,
                    msg=lambda m, name=name, layer=layer, rank=rank: f"{case}, rank {rank}, layer {layer} {name}: {m}",
                )  # fmt: skip


def _ep2_checkpoint_read_at_ep1_and_ep4(folder: str) -> list[bool]:
    """Train 2 steps at ep2 (× dp_rep 2), checkpoint, take a third step; load the checkpoint into fresh models
    laid out without expert parallelism (DDP), at ep4 under ZeRO-1 (optimizer state spread over the ranks
    holding the same experts) and at ep2 with uneven experts 1:3 under ZeRO-3 (each rank's experts sharded
    over the 2 ranks holding them), on the same ranks: for each, the
    same weights, and after the same third step (which reads the Adam moments) the same weights as the ep2
    run's (1e-5). Then the uneven run's own checkpoint (its experts gathered whole) loads into DDP: the same
    weights, and the same weights again after a fourth step on both."""
    from parity import TokenData, build_model, loss_fn

    from tessera.checkpoint import load_checkpoint, save_checkpoint

    def laid_out(plan: tessera.Plan, seed: int) -> tuple:
        booster = tessera.Booster(plan)
        model = build_model("moe_llama", seed=seed)
        model, optimizer = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return booster, model, optimizer

    def train(booster: tessera.Booster, model: torch.nn.Module, optimizer: object, first: int, last: int) -> None:
        for step, batch in enumerate(booster.dataloader(TokenData(), global_batch_size=8, seed=0)):
            if first <= step < last:
                booster.backward(loss_fn(model(batch["x"]), batch["y"]), optimizer)
                optimizer.step()
                optimizer.zero_grad()

    def close(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-5) for k in a)

    booster, model, optimizer = laid_out(tessera.Plan(ep=2), 0)
    train(booster, model, optimizer, 0, 2)
    path = save_checkpoint(folder, 2, model, optimizer, {"step": 2}, 1, {"run_id": "ep"})
    saved = booster.full_state_dict(model)
    train(booster, model, optimizer, 2, 3)
    want = booster.full_state_dict(model)
    loaded = []
    for plan in (tessera.Plan(), tessera.Plan(ep=4, zero=1), tessera.Plan(ep=2, expert_shares=(1, 3), zero=3)):
        again, other, other_optimizer = laid_out(plan, 1)
        load_checkpoint(path, other, other_optimizer)
        same = close(saved, again.full_state_dict(other))
        train(again, other, other_optimizer, 2, 3)
        loaded.append(same and close(want, again.full_state_dict(other)))
    path = save_checkpoint(folder, 3, other, other_optimizer, {"step": 3}, 1, {"run_id": "ep"})  # uneven experts
    last, plain, plain_optimizer = laid_out(tessera.Plan(), 2)
    load_checkpoint(path, plain, plain_optimizer)
    same = close(again.full_state_dict(other), last.full_state_dict(plain))
    train(again, other, other_optimizer, 3, 4)
    train(last, plain, plain_optimizer, 3, 4)
    return [*loaded, same and close(again.full_state_dict(other), last.full_state_dict(plain))]


def _train_moe(config: dict) -> dict:
    import contextlib
    import io

    from test_checkpoint import train_worker

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train_worker(config)
    return {"printed": printed.getvalue()}


def test_an_ep2_checkpoint_loads_at_ep1_and_ep4_and_training_reports_the_experts(tmp_path: Path) -> None:
    """One 4-rank launch. A checkpoint written at ep2 × dp_rep2 loads into DDP (ep1) and at ep4 under ZeRO-1
    with the same weights and Adam moments. `model.moe` in a training config, DDP, 3 steps: metrics.jsonl holds
    every layer's routed slots per expert for the whole batch (global batch × sequence × top_k each step) and the
    balance loss; experts.png is drawn; with a warning share below the even share the warning comes after
    warn_steps."""
    import json

    from test_checkpoint import tiny_config

    config = tiny_config(tmp_path, 3, 3, {"preset": "ddp"})
    config["model"]["moe"] = {"experts": 4, "top_k": 2, "bias_rate": 0.01, "warn_share": 0.2, "warn_steps": 2}
    both = run_shared(4, {"ep2 -> ep1, ep4, uneven": (_ep2_checkpoint_read_at_ep1_and_ep4, (str(tmp_path / "ep"),)),
                          "train": (_train_moe, (config,))})  # fmt: skip
    for rank in both["ep2 -> ep1, ep4, uneven"]:
        assert rank == [True] * 4, "ep2 checkpoints load under DDP, at ep4 and with uneven experts, and back"
    out = both["train"]
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_expert" in r]
    assert len(steps) == 3
    for r in steps:
        assert len(r["tokens_per_expert"]) == 2 and all(len(layer) == 4 for layer in r["tokens_per_expert"])
        assert all(sum(layer) == 8 * 32 * 2 for layer in r["tokens_per_expert"]), r["tokens_per_expert"]
        assert 0 < r["balance_loss"] < 4  # E · Σ f·P: 1 when even, E when one expert takes everything
    assert (tmp_path / "t" / "experts.png").is_file()
    assert "one expert took" in out[0]["printed"] and "model.moe.bias_rate" in out[0]["printed"]


def test_the_planner_counts_active_experts_and_places_experts_by_speed_and_memory() -> None:
    """An MoE block costs the FLOPs of its top_k experts (8 experts top-2 cost what 2 experts top-2 do, with
    4× the parameters); experts go to ranks in proportion to speed, within memory; on a cluster of speeds 4,
    4, 2, 2 the planner offers the data-parallel layouts with experts split over ep, held 3, 3, 1, 1, and
    predicts that placement faster than an even one; a dense model gets no ep."""
    from tessera.cluster.spec import Cluster, Link
    from tessera.planner import ModelCosts, plan_for
    from tessera.planner.experts import expert_costs, expert_seconds, place_experts

    def llama(experts: int) -> Llama:
        with torch.device("meta"):
            moe = MoESpec(experts=experts, top_k=2) if experts else None
            return Llama(LlamaConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=512,
                                     max_seq_len=64, moe=moe))  # fmt: skip

    eight, two = ModelCosts.from_model(llama(8), 64), ModelCosts.from_model(llama(2), 64)
    assert eight.parts["block"].forward_s == pytest.approx(two.parts["block"].forward_s, rel=0.01)  # (routers)
    assert eight.parts["block"].params > 3 * two.parts["block"].params
    assert place_experts([4, 4, 2, 2], 8) == (3, 3, 1, 1) and place_experts([1, 1, 1, 1], 8) == (2, 2, 2, 2)
    assert place_experts([4, 4, 2, 2], 8, capacity=[2, 8, 8, 8]) == (2, 4, 1, 1)
    with pytest.raises(ValueError, match="3 experts cannot give each of 4 ranks one"):
        place_experts([1, 1, 1, 1], 3)
    costs = expert_costs(llama(8))
    assert costs is not None and (costs.experts, costs.top_k, costs.layers) == (8, 2, 4)
    fast = Link(100.0, 1.0)
    even = expert_seconds(costs, 64, [8, 8, 4, 4], [4, 4, 2, 2], (2, 2, 2, 2), fast)
    placed = expert_seconds(costs, 64, [8, 8, 4, 4], [4, 4, 2, 2], (3, 3, 1, 1), fast)
    assert placed.compute_s == pytest.approx(even.compute_s * 3 / 4)  # slowest: 3/8 at 4 vs 2/8 at 2

    cluster = Cluster.from_dict({
        "nodes": [{"name": "a", "devices": [{"type": "full", "count": 2}]},
                  {"name": "b", "devices": [{"type": "half", "count": 2}]}],
        "device_types": {"full": {"peak_tflops": {"fp32": 4}, "memory_gib": 8, "bandwidth_gbs": 100},
                         "half": {"peak_tflops": {"fp32": 2}, "memory_gib": 8, "bandwidth_gbs": 100}},
        "links": {"inter_node": {"bandwidth_gbs": 1.0, "latency_us": 100}},
    })  # fmt: skip
    found = plan_for(cluster, llama(8), 32, top=1000)
    split = [c for c in found if c.plan.ep == 4]
    assert split and all(c.plan.expert_shares == (3, 3, 1, 1) for c in split)
    assert "held [3, 3, 1, 1] by device speed" in split[0].notes[-1]
    assert all(c.plan.ep == 1 for c in plan_for(cluster, llama(0), 32, top=1000))


@pytest.mark.parametrize("family", ["Mixtral", "Qwen2Moe", "Qwen3Moe"])
def test_hugging_face_experts_through_tessera_s_dispatch_compute_transformers_forward(family: str) -> None:
    """Each Hugging Face family the MoE policy names: its experts' rows through Tessera's dispatch (what
    expert parallelism runs) give transformers' own forward's output and gradients (1e-5)."""
    import transformers

    from tessera.models.hf_experts import expert_modules
    from tessera.models.moe import dispatch

    config = getattr(transformers, f"{family}Config")(
        hidden_size=32, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, num_experts_per_tok=2, num_local_experts=4, num_experts=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    (experts,) = expert_modules(model)
    hidden = torch.randn(24, 32)
    chosen = torch.stack([torch.randperm(4)[:2] for _ in range(24)])
    weights = torch.rand(24, 2)
    upstream = torch.randn(24, 32)
    results = []
    for forward in (experts.own_forward, lambda h, c, w: dispatch(h, c, w, experts.rows_through, 4)):
        experts.zero_grad()
        x = hidden.clone().requires_grad_()
        out = forward(x, chosen, weights)
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
