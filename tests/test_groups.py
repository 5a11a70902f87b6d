"""Plan.groups: groups of ranks that train apart and meet at DiLoCo's outer step (issue 14).

Every case runs on 4 real gloo ranks (2 groups × 2 data-parallel ranks) in one launch and is
compared with plain single-process PyTorch: synchronous SGD where DiLoCo must reduce to it, and
a single-process replay of DiLoCo itself (two model copies, each with its own optimizer) where
it must not. The same launch runs ``tessera train`` with groups: stopped between outer syncs and
resumed, it ends bit for bit where the straight run does.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from parity import TokenData, build_model, global_batches, loss_fn, plain_loop_losses, reference_run, run_shared
from test_checkpoint import checkpoint_tensors, ckpt, tiny_config, train_each

from tessera import Plan, PlanError, ZeRO
from tessera.across.compress import ErrorFeedback, decode, encode
from tessera.errors import NotSupportedYet
from tessera.plan.groups import Groups
from tessera.train.metrics import latest_records

GLOBAL_BATCH, STEPS, GROUPS = 8, 4, 2
SGD_LR, ADAM_LR = 0.1, 3e-3


def _inner_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=SGD_LR)
    return torch.optim.AdamW(params, lr=ADAM_LR, eps=1e-6)


def groups_worker(plan_dict: dict, inner: str, steps: int = STEPS, fed: bool = False) -> dict:
    """Train ``plan_dict`` through the Booster; every rank returns the losses, its group's full weights and
    the bytes it sent per link class (tessera.traffic); ``fed``: also, per fragment, every value its error
    feedback was given to encode, in order, and the remainder it kept at the end."""
    import tessera
    from tessera import traffic

    model = build_model("llama")
    booster = tessera.Booster(Plan.from_dict(plan_dict))
    model, opt = booster.boost(model, _inner_optimizer(inner, model.parameters()))
    given: list[list[torch.Tensor]] = []
    if fed:
        for fragment in booster.membership.outer.fragments:
            given.append([])
            encode = fragment.feedback.encode
            fragment.feedback.encode = lambda v, into=given[-1], encode=encode: (into.append(v.clone()), encode(v))[1]
    traffic.take()
    if booster.plan.pp > 1:  # a pipeline inside each group trains through execute_pipeline
        losses = []
        for batch in itertools.islice(booster.dataloader(TokenData(), GLOBAL_BATCH, seed=0), steps):
            loss = booster.execute_pipeline(batch, model, loss_fn, opt)
            opt.step()
            opt.zero_grad()
            losses.append(float(booster.reduce_loss(loss)))
    else:
        losses = plain_loop_losses(booster, model, opt, GLOBAL_BATCH, steps)
    sent = {link: t.bytes for link, t in traffic.take().items()}  # the training steps' collectives
    out = {"losses": losses, "params": booster.full_state_dict(model), "group": booster.group_index, "sent": sent}
    if fed:
        out["fed"] = given
        out["remainders"] = [fragment.feedback.remainder.clone() for fragment in booster.membership.outer.fragments]
    return out


def unlike_groups_worker(second: str, steps: int = STEPS) -> dict:
    """Two groups laid out differently, meeting in canonical slots: group 0 (ranks 0, 1) shards every
    parameter with FSDP2 (ZeRO-3); group 1 (ranks 2, 3) holds whole replicas and averages its gradients
    itself (``second`` "replicas"), splits the model tensor-parallel over its two ranks ("tp"), or holds
    it as two pipeline stages ("stages": rank 2 the embedding and layer 0, rank 3 the rest; both compute
    the whole model here, and after each sync each takes the other stage's weights from its holder, as a
    pipeline's stages never need them). DiLoCo with H = 1, inner SGD, outer lr 1 and no outer momentum:
    synchronous SGD."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tessera.across.meet import MeshAcross
    from tessera.across.outer import OuterSync
    from tessera.models.policies import find_policy
    from tessera.parallel.tensor import align_grad_placements, apply_tensor_parallel

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (GROUPS, 2), mesh_dim_names=("group", "dp"))
    group, inside = rank // 2, mesh["dp"].get_group()
    model = build_model("llama")
    tp = group == 1 and second == "tp"
    staged = group == 1 and second == "stages"
    first_stage = ("tok_embeddings.", "layers.0.")
    stage_of = {n: 0 if n.startswith(first_stage) else 1 for n, _ in model.named_parameters()}
    if group == 0:
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif tp:
        apply_tensor_parallel(model, model, find_policy(model), mesh["dp"])
    opt = _inner_optimizer("sgd", model.parameters())
    spec = Groups(count=GROUPS, sync="diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    across = MeshAcross(mesh["group"].get_group())  # rank r of each group: slot r
    held = {n: p for n, p in model.named_parameters() if not staged or stage_of[n] == rank - 2}
    order = [n for n, _ in model.named_parameters()]
    if staged and rank == 3:  # a stage may hold its parameters in another order (tessera's last stage does)
        held = dict(reversed(held.items()))
    outer = OuterSync(held, across, spec, [0.5, 0.5], group, members=inside, slots=2, order=order)
    losses = []
    for x, y in global_batches(TokenData(), GLOBAL_BATCH, steps):
        # a quarter of the global batch per rank; tensor parallel ranks share their group's half
        mine = slice(4, 8) if tp or staged else slice(2 * rank, 2 * rank + 2)
        loss = loss_fn(model(x[mine]), y[mine])
        loss.backward()
        if tp:
            align_grad_placements(model.parameters())
        elif group == 1 and not staged:  # whole replicas: average the group's gradients (FSDP does it in group 0)
            for p in model.parameters():
                dist.all_reduce(p.grad, group=inside)
                p.grad /= 2
        opt.step()
        opt.zero_grad()
        outer.after_inner_step()
        if staged:  # each stage's weights from the rank that holds (and synced) them
            with torch.no_grad():
                for n, p in model.named_parameters():
                    dist.broadcast(p, src=2 + stage_of[n], group=inside)
        mean = loss.detach().clone()  # tp, stages: each rank holds its group's mean over 4 samples
        dist.all_reduce(mean)
        losses.append(float(mean) / 4)
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "group": group}


def synchronous_reference(steps: int) -> dict:
    """Plain SGD over the whole global batch, one process."""
    model = build_model("llama")
    opt = _inner_optimizer("sgd", model.parameters())
    losses = []
    for x, y in global_batches(TokenData(), GLOBAL_BATCH, steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": [dict(model.state_dict())] * GROUPS}


def outer_reference(inner: str, steps: int, spec: Groups | None) -> dict:
    """DiLoCo (and Streaming DiLoCo) replayed in one process: a model and an optimizer per group, each
    taking its part of every global batch. Fragment f of the layers leaves at
    steps (f + 1)·H/F, then every H: its mean change (agreed − current) steps the agreed weights with
    the outer SGD ``delay`` steps later, and the groups continue from them plus what those steps
    changed locally. ``spec`` None: the groups never meet."""
    models = [build_model("llama") for _ in range(GROUPS)]
    inners = [_inner_optimizer(inner, m.parameters()) for m in models]
    params = [list(m.parameters()) for m in models]
    agreed = [p.detach().clone() for p in params[0]]
    fragments = spec.fragments if spec else 1
    assert fragments in (1, 2), "the replay knows the 2-layer model's split in two"
    # Streaming DiLoCo's fragments are runs of whole layers: with two, the embeddings and layer 0, then
    # layer 1 with the final norm and the head.
    names = [name for name, _ in models[0].named_parameters()]
    split = next(i for i, name in enumerate(names) if name.startswith("layers.1.")) if fragments == 2 else len(names)
    runs = [(0, split), (split, len(names))] if fragments == 2 else [(0, len(names))]
    outers = [
        torch.optim.SGD(agreed[a:b], lr=spec.outer_lr, momentum=spec.outer_momentum, nesterov=spec.nesterov)
        for a, b in runs
    ] if spec else []  # fmt: skip
    in_flight: dict[int, tuple[int, list, list]] = {}  # fragment -> (due step, mean change, pieces as sent)
    kind = spec.compression if spec else "none"
    feedback = [[ErrorFeedback(kind) for _ in runs] for _ in range(GROUPS)]  # per group and fragment

    def mean_change(f: int) -> list[torch.Tensor]:
        a, b = runs[f]
        if kind == "none":
            return [sum(agreed[i] - params[k][i] for k in range(GROUPS)) / GROUPS for i in range(a, b)]
        flats = [torch.cat([(agreed[i] - params[k][i]).flatten() for i in range(a, b)]) / GROUPS for k in range(GROUPS)]
        total = sum(decode(feedback[k][f].encode(flat), kind, flat.numel()) for k, flat in enumerate(flats))
        return list(total.split([agreed[i].numel() for i in range(a, b)]))

    def land(f: int) -> None:
        (a, b), (_, change, sent) = runs[f], in_flight.pop(f)
        for i, g in zip(range(a, b), change):
            agreed[i].grad = g.view_as(agreed[i])
        outers[f].step()
        outers[f].zero_grad()
        for k in range(GROUPS):
            for j, i in enumerate(range(a, b)):
                params[k][i].copy_(agreed[i] + (params[k][i] - sent[k][j]) if spec.delay else agreed[i])

    losses = []
    for t, (x, y) in enumerate(global_batches(TokenData(), GLOBAL_BATCH, steps), start=1):
        parts = []
        for model, opt, xs, ys in zip(models, inners, x.chunk(GROUPS), y.chunk(GROUPS)):
            loss = loss_fn(model(xs), ys)
            loss.backward()
            opt.step()
            opt.zero_grad()
            parts.append(loss.item())
        losses.append(sum(parts) / GROUPS)
        if spec is None:
            continue
        with torch.no_grad():
            for f in [f for f, (due, _, _) in in_flight.items() if t >= due]:
                land(f)
            turn = spec.inner_steps // fragments
            for f, (a, b) in enumerate(runs):
                first = (f + 1) * turn
                if t >= first and (t - first) % spec.inner_steps == 0:
                    change = mean_change(f)
                    sent = [[params[k][i].clone() for i in range(a, b)] for k in range(GROUPS)]
                    in_flight[f] = (t + spec.delay, change, sent)
                    if not spec.delay:
                        land(f)
    return {"losses": losses, "params": [dict(m.state_dict()) for m in models]}


def _plan(zero: int = 0, **groups) -> dict:
    return {"zero": zero, "groups": groups}


DILOCO = {"count": GROUPS, "sync": "diloco", "inner_steps": 2, "outer_lr": 0.7, "outer_momentum": 0.9}
# two fragments taking turns every 2 steps, each landing a step after it leaves: over 6 steps, fragment 0
# leaves at 2 and lands at 3, fragment 1 leaves at 4 and lands at 5, fragment 0 leaves again at 6
STREAMING = {**DILOCO, "sync": "streaming", "inner_steps": 4, "fragments": 2, "delay": 1}
STREAMING_STEPS = 6
COMPRESSED_STEPS = 8  # streaming's fragment 1 syncs at 4 and 8
CASES = {
    # H = 1, inner SGD without momentum, outer lr 1 and no outer momentum: synchronous SGD
    "diloco reduces to sync sgd": (
        _plan(**{**DILOCO, "inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}),
        "sgd",
    ),
    "diloco adamw h2": (_plan(**DILOCO), "adamw"),
    "diloco adamw h2 zero3": (_plan(zero=3, **DILOCO), "adamw"),
    "diloco adamw h2 pp2": ({"pp": 2, "pipeline": {"microbatches": 2}, "groups": DILOCO}, "adamw"),  # per stage
    "islands": (_plan(count=GROUPS, sync="none"), "adamw"),
    "streaming one fragment": (_plan(**{**DILOCO, "sync": "streaming"}), "adamw"),
    "streaming": (_plan(zero=3, **STREAMING), "adamw", STREAMING_STEPS),
    # enough syncs that what error feedback carries from one to the next matters: 2 of DiLoCo's, 2 of each fragment
    "diloco int8": (_plan(**{**DILOCO, "compression": "int8"}), "adamw", STEPS, True),
    "streaming int4": (_plan(**{**STREAMING, "compression": "int4"}), "adamw", COMPRESSED_STEPS, True),
    # every step, hierarchically: synchronous training, whatever the layout inside the groups
    "every step ddp": (_plan(count=GROUPS, sync="every_step"), "adamw"),
    "every step zero1": (_plan(zero=1, count=GROUPS, sync="every_step"), "adamw"),
    "every step zero3": (_plan(zero=3, count=GROUPS, sync="every_step"), "adamw"),
    "every step ddp shares 3:1": (_plan(count=GROUPS, sync="every_step", shares=[3, 1]), "adamw"),
}


# tessera train with groups: straight to step 8, and stopped after step 4 then resumed. At step 4 DiLoCo
# (H = 3) is between syncs with outer momentum and int8 error feedback, split between DDP's replicas;
# Streaming's fragment 1 is in flight (it left at 4, lands at 5) and fragment 0 has momentum and error
# feedback.
TRAIN_PLANS = {
    "diloco ddp int8": {"preset": "ddp", "groups": {**DILOCO, "inner_steps": 3, "compression": "int8"}},
    "streaming zero3 int8": {"preset": "zero", "zero": 3, "groups": {**STREAMING, "compression": "int8"}},
    "diloco pp2": {"preset": "ddp", "pp": 2, "microbatches": 2, "groups": {**DILOCO, "inner_steps": 3}},
}
TRAIN_STEPS, STOP_AT = 8, 4


def train_stop_resume(root: str, plan: dict) -> list[dict]:
    return train_each([
        tiny_config(Path(root) / "straight", TRAIN_STEPS, 0, plan),
        tiny_config(Path(root) / "split", TRAIN_STEPS, 0, plan, stop_at=STOP_AT),
        tiny_config(Path(root) / "split", TRAIN_STEPS, 0, plan),
    ])  # fmt: skip


def refusals(root: str) -> list[str]:
    """Resume ``tessera train`` runs under other groups: the errors, one per try."""
    from tessera.checkpoint.readers import CheckpointError

    grouped = Path(root) / "grouped"
    train_each([tiny_config(grouped, 1, 0, TRAIN_PLANS["diloco ddp int8"])])
    tries = [
        tiny_config(grouped, 2, 0, {"preset": "ddp"}),
        tiny_config(grouped, 2, 0, {"preset": "ddp", "groups": {**DILOCO, "count": 4}}),
    ]
    out = []
    for config in tries:
        try:
            train_each([config])
            out.append("no error")
        except CheckpointError as exc:
            out.append(str(exc))
    return out


# A warm start: a plain DDP run stopped at step 2 resumes under groups. (a) DiLoCo that reduces to
# synchronous SGD (H = 1, inner SGD, outer lr 1, no momentum) continues exactly as the plain run does;
# (b) with H = 2 the outer loop's agreed weights at step 3 (no sync since the start) are step 2's weights.
WARM_SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.0, "grad_clip": None}
AS_SYNC_SGD = {**DILOCO, "inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}


def warm_start(root: str) -> list[dict]:
    def sgd(config: dict) -> dict:
        return {**config, "optimizer": WARM_SGD}

    plain, base = {"preset": "ddp"}, Path(root)
    return train_each([
        sgd(tiny_config(base / "straight", 4, 0, plain)),
        sgd(tiny_config(base / "as-sync", 4, 0, plain, stop_at=2)),
        sgd(tiny_config(base / "as-sync", 4, 0, {"preset": "ddp", "groups": AS_SYNC_SGD})),
        tiny_config(base / "anchor", 3, 0, plain, stop_at=2),
        tiny_config(base / "anchor", 3, 0, {"preset": "ddp", "groups": DILOCO}),
    ])  # fmt: skip


def refused_fragments() -> str:
    """Streaming DiLoCo with 3 fragments of a 2-layer model: the error every rank gets."""
    import tessera

    model = build_model("llama")
    booster = tessera.Booster(Plan.from_dict(_plan(**{**STREAMING, "inner_steps": 6, "fragments": 3})))
    try:
        booster.boost(model, _inner_optimizer("adamw", model.parameters()))
    except PlanError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def train_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: tmp_path_factory.mktemp(name.replace(" ", "-")) for name in [*TRAIN_PLANS, "refusals", "warm"]}


@pytest.fixture(scope="module")
def runs(train_roots: dict[str, Path]) -> dict[str, list]:
    calls = {name: (groups_worker, args) for name, args in CASES.items()}
    calls.update(
        {f"train {name}": (train_stop_resume, (str(train_roots[name]), plan)) for name, plan in TRAIN_PLANS.items()}
    )
    calls["refusals"] = (refusals, (str(train_roots["refusals"]),))
    calls["warm"] = (warm_start, (str(train_roots["warm"]),))
    calls["fragments"] = (refused_fragments, ())
    calls["unlike groups"] = (unlike_groups_worker, ("replicas",))
    calls["unlike groups tp"] = (unlike_groups_worker, ("tp",))
    calls["unlike groups stages"] = (unlike_groups_worker, ("stages",))
    return run_shared(4, calls)


def _same(got: list[dict], want: dict, atol: float = 1e-5) -> None:
    """Every rank's losses equal the reference's, and its group's weights equal that group's there."""
    for rank, result in enumerate(got):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=atol)
        expected = want["params"][result["group"]]
        assert result["params"].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(
                result["params"][key], value, rtol=1e-5, atol=atol, msg=lambda m, k=key, r=rank: f"rank {r} {k}: {m}"
            )


def test_diloco_with_one_inner_sgd_step_is_synchronous_sgd(runs: dict) -> None:
    got = runs["diloco reduces to sync sgd"]
    assert [r["group"] for r in got] == [0, 0, 1, 1]
    _same(got, synchronous_reference(STEPS))


@pytest.mark.parametrize("case", ["unlike groups", "unlike groups tp", "unlike groups stages"])
def test_groups_laid_out_differently_meet_in_canonical_slots(runs: dict, case: str) -> None:
    """One group of FSDP shards, the other of whole replicas, tensor-parallel shards or pipeline stages: each
    cuts the same flat of whole parameters into slots (a sharded one gathering each parameter inside the
    group, a staged one sending it from its stage, then each taking its pieces back), so DiLoCo that reduces
    to synchronous SGD still does."""
    got = runs[case]
    assert [r["group"] for r in got] == [0, 0, 1, 1]
    _same(got, synchronous_reference(STEPS))


@pytest.mark.parametrize("case", ["diloco adamw h2", "diloco adamw h2 zero3", "diloco adamw h2 pp2"])
def test_diloco_with_adamw_equals_its_single_process_replay(runs: dict, case: str) -> None:
    """Each group's AdamW follows its own gradients, so this is not synchronous training: it must equal
    DiLoCo replayed in one process, under DDP and under ZeRO-3 (the outer step works on shards)."""
    _same(runs[case], outer_reference("adamw", STEPS, Groups(**DILOCO)))


@pytest.mark.parametrize(
    "case", ["every step ddp", "every step zero1", "every step zero3", "every step ddp shares 3:1"]
)
def test_every_step_groups_train_as_one_process(runs: dict, case: str) -> None:
    """Hierarchical averaging (DDP's hook: reduce-scatter in a group, all-reduce across, all-gather in;
    FSDP's HSDP mesh) equals one process on the whole batch, also when the groups take 6 and 2 samples."""
    want = reference_run("llama", GLOBAL_BATCH, STEPS, lr=ADAM_LR)
    _same(runs[case], {"losses": want["losses"], "params": [want["params"]] * GROUPS})


def test_streaming_with_one_fragment_and_no_delay_is_diloco(runs: dict) -> None:
    _same(runs["streaming one fragment"], outer_reference("adamw", STEPS, Groups(**DILOCO)))


def test_streaming_fragments_take_turns_and_land_late(runs: dict) -> None:
    """Two fragments, each synced every 4 steps in turn and landing a step after it leaves, under ZeRO-3:
    equal to the same algorithm replayed in one process."""
    _same(runs["streaming"], outer_reference("adamw", STREAMING_STEPS, Groups(**STREAMING)))


@pytest.mark.parametrize(("case", "spec", "steps"), [
    ("diloco int8", {**DILOCO, "compression": "int8"}, STEPS),
    ("streaming int4", {**STREAMING, "compression": "int4"}, COMPRESSED_STEPS),
])  # fmt: skip
def test_compressed_outer_gradients_equal_their_replay(runs: dict, case: str, spec: dict, steps: int) -> None:
    """Each group quantises its outer gradient (with error feedback), every group sums all of them in the
    same order: the groups agree bit for bit, and equal the replay, which quantises each group's apart."""
    got = runs[case]
    # A value 1e-7 from a rounding boundary of the quantiser may land one step away in the replay:
    # one step of the outer gradient, times the outer lr, is the tolerance.
    _same(got, outer_reference("adamw", steps, Groups(**spec)), atol=1e-4)
    plain = outer_reference("adamw", steps, Groups(**{**spec, "compression": "none"}))
    gap = max((got[0]["params"][k] - v).abs().max().item() for k, v in plain["params"][0].items())
    assert gap > 5e-4, gap  # it did quantise: 5x the tolerance


@pytest.mark.parametrize("case", ["diloco int8", "streaming int4"])
def test_error_feedback_carries_its_remainder_from_sync_to_sync(runs: dict, case: str) -> None:
    """What each rank's error feedback keeps after its last sync is exactly what one ErrorFeedback keeps when
    given, in order, the same values each sync gave it: what a sync dropped is added to the next one's
    values, never reset between syncs (every fragment syncs at least twice here)."""
    kind = CASES[case][0]["groups"]["compression"]
    for rank, result in enumerate(runs[case]):
        for f, (given, kept) in enumerate(zip(result["fed"], result["remainders"])):
            assert len(given) >= 2, (rank, f, len(given))
            feedback = ErrorFeedback(kind)
            for values in given:
                feedback.encode(values)
            assert torch.equal(feedback.remainder, kept), f"rank {rank}, fragment {f}"


@pytest.mark.parametrize(("kind", "bound"), [("bf16", 2**-8), ("int8", 1 / 254), ("int4", 1 / 14)])
def test_compression_error_is_bounded_and_feedback_carries_the_rest(kind: str, bound: float) -> None:
    """One encoding errs by at most half a quantisation step of its block's largest value (bf16: its
    relative precision); error feedback adds what was dropped to the next values, so over many syncs
    of the same values the sum of what was sent stays within one encoding's error of the truth."""
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1000, generator=g) * torch.linspace(0.01, 10, 1000)  # 1000: not a multiple of a block
    once = decode(encode(values, kind), kind, values.numel())
    scale = values.abs() if kind == "bf16" else values.abs().max()
    assert ((once - values).abs() <= bound * scale + 1e-12).all()
    feedback, sent = ErrorFeedback(kind), torch.zeros_like(values)
    for _ in range(50):
        sent += decode(feedback.encode(values), kind, values.numel())
    torch.testing.assert_close(sent + feedback.remainder, 50 * values, rtol=1e-5, atol=1e-4)
    assert (sent / 50 - values).abs().max() < (once - values).abs().max()  # carried, not lost


def test_islands_never_meet(runs: dict) -> None:
    got = runs["islands"]
    _same(got, outer_reference("adamw", STEPS, None))
    assert not torch.equal(
        got[0]["params"]["layers.0.attention.wq.weight"], got[2]["params"]["layers.0.attention.wq.weight"]
    )


@pytest.mark.parametrize(
    ("groups", "world", "error", "match"),
    [
        ({"inner_steps": 0}, 4, PlanError, "inner_steps must be an integer from 1"),
        ({"count": 3}, 4, PlanError, "count=3 does not divide the 4 ranks"),
        ({"sync": "diloko"}, 4, PlanError, 'did you mean "diloco"'),
        ({"shares": [1, 2, 3]}, 4, PlanError, "one positive integer per group"),
        ({"outer_momentum": 1.0}, 4, PlanError, r"outer_momentum must be in \[0, 1\)"),
        ({"outer_lr": float("nan")}, 4, PlanError, "outer_lr must be a finite number"),
        ({"inner_step": 5}, 4, PlanError, 'did you mean "inner_steps"'),
        ({"sync": "streaming", "inner_steps": 6, "fragments": 4}, 4, PlanError, "fragments=4 does not divide"),
        ({"sync": "streaming", "inner_steps": 4, "fragments": 2, "delay": 2}, 4, PlanError, "delay=2 must be below"),
        ({"sync": "diloco", "fragments": 2}, 4, PlanError, "set sync: streaming"),
        ({"compression": "int3"}, 4, PlanError, "compression='int3' is not one of"),
        ({"sync": "every_step", "compression": "int8"}, 4, PlanError, "sync: every_step sends none"),
        ({"sync": "every_step", "fault_tolerant": True}, 4, PlanError, "use sync: diloco or streaming"),
        ({"fault_tolerant": "yes"}, 4, PlanError, "fault_tolerant must be true or false"),
        ({"sizes": [3, 1]}, 4, PlanError, "differ: groups of different sizes run as separate jobs"),
        ({"sizes": [2, 2, 2]}, 6, PlanError, "sizes must list the ranks of each of the 2 groups"),
        ({"sizes": [3, 3]}, 4, PlanError, r"sizes=\[3, 3\] make 6 ranks but 4 were launched"),
        ({"layouts": [{"zero": 3}, {}]}, 4, PlanError, "each group is its own job: set fault_tolerant: true"),
        ({"fault_tolerant": True, "layouts": [{}]}, 4, PlanError, "one mapping per group \\(2\\)"),
        ({"fault_tolerant": True, "layouts": [{"sp": 2}, {}]}, 4, PlanError, r"layouts\[0\] has no field 'sp'"),
        ({"fault_tolerant": True, "layouts": [{"zero": 4}, {}]}, 4, PlanError, r"layouts\[0\]: Plan.zero must be"),
        (
            {"fault_tolerant": True, "layouts": [{}, {"schedule": "gpipe2"}]},
            4,
            PlanError,
            r"layouts\[1\]: Plan.pipeline.schedule='gpipe2' is not one of",
        ),
    ],
)
def test_bad_groups_are_clear_errors(groups: dict, world: int, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Plan.from_dict({"groups": groups}).resolve(world)


def test_groups_with_replicas_or_every_step_pipelines_are_refused_until_supported() -> None:
    every_step = {"count": 2, "sync": "every_step"}
    with pytest.raises(NotSupportedYet, match="'every_step' with pipeline stages"):
        Plan.from_dict({"pp": 2, "pipeline": {"microbatches": 2}, "groups": every_step}).resolve(8)
    replicas = [{"stages": [[0, 2]], "share": 1}, {"stages": [[0, 2]], "share": 1}]
    with pytest.raises(NotSupportedYet, match="Plan.groups with Plan.replicas"):
        Plan.from_dict({"replicas": replicas, "groups": {"count": 2}}).resolve(2)
    plan = Plan.from_dict({"pp": 2, "pipeline": {"microbatches": 2}, "groups": {"count": 2}}).resolve(8)
    assert plan.mesh_shape() == ((2, 2, 2), ("group", "pp", "dp"))


def test_a_groups_rank_layout_is_group_major() -> None:
    plan = Plan(tp=2, groups=Groups(count=2, shares=(3, 1))).resolve(8)
    assert plan.dp == 2 and plan.mesh_shape() == ((2, 2, 2), ("group", "dp", "tp"))
    assert [plan.coords(r).group for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(plan.rank_at(plan.coords(r)) == r for r in range(8))
    assert plan.batch_split(16) == [6, 6, 2, 2]
    assert [plan.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    # the README's one line: the presets take groups
    zero2 = ZeRO(stage=2, groups=Groups(count=2, sync="diloco", inner_steps=50)).resolve(8)
    assert (zero2.zero, zero2.dp, zero2.groups.inner_steps) == (2, 4, 50)


N_PARAMS = sum(p.numel() for p in build_model("llama").parameters())
# DDP's two replicas in a group sync a slice each (whole int8 blocks of 256 weights): half the model
SLICE = -(-N_PARAMS // (2 * 256)) * 256
LOSS_BYTES = 4 * STEPS  # reduce_loss: one fp32 mean across the groups a step


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("diloco adamw h2", 2 * 4 * SLICE + LOSS_BYTES),  # two syncs of half the fp32 weights (2 groups: x1)
        ("diloco adamw h2 zero3", 2 * 4 * N_PARAMS // 2 + LOSS_BYTES),  # ZeRO-3: each rank syncs its shard
        ("diloco int8", 2 * SLICE * (1 + 4 / 256) + LOSS_BYTES),  # a byte a weight, an fp32 scale a block
        ("islands", LOSS_BYTES),  # never meet
    ],
)
def test_the_bytes_across_groups_are_the_outer_syncs(runs: dict, case: str, want: int) -> None:
    """tessera.traffic's count of what crossed between the groups, on every rank: exactly the outer syncs
    (and the reported loss), while the gradients stay inside the groups. A group's replicas split the
    sync, so the model crosses once per group, not once per rank."""
    for result in runs[case]:
        assert result["sent"]["across_groups"] == want, (case, result["sent"])
        assert result["sent"]["intra_node"] > STEPS * 4 * N_PARAMS // 2  # the in-group gradient sync
        assert result["sent"]["inter_node"] == 0  # one machine


def test_every_step_groups_send_a_slice_of_the_gradients_across(runs: dict) -> None:
    """Hierarchical every-step sync: each rank sends its half of the gradients across (one all-reduce of a
    reduce-scattered slice), not all of them as a flat all-reduce over the 4 ranks would (1.5x)."""
    for result in runs["every step ddp"]:
        slices = result["sent"]["across_groups"] - LOSS_BYTES
        assert STEPS * 4 * N_PARAMS / 2 <= slices <= 1.01 * STEPS * 4 * N_PARAMS / 2, result["sent"]


def _group_tensors(run: Path, step: int, group: int, tmp: Path) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(ckpt(run, step) / f"group_{group}", tmp, prefixes=("model.", "optim.state.", "outer."))


@pytest.mark.parametrize("case", list(TRAIN_PLANS))
def test_tessera_train_with_groups_resumes_bit_for_bit_between_outer_syncs(
    runs: dict, train_roots: dict, case: str, tmp_path: Path
) -> None:
    """Each group writes its own folder (weights, inner optimizer, outer state); stopped after step 4 and
    resumed, the run reaches the straight run's step 8 bit for bit: losses, weights, AdamW and outer state."""
    straight, stopped, resumed = runs[f"train {case}"][0]
    assert resumed["resumed_from"].endswith(f"step_{STOP_AT:08d}")
    assert resumed["last_loss"] == straight["last_loss"]
    root = train_roots[case]
    # every step's record (log_every 1) says what crossed between the groups; the summary adds them up
    records = latest_records(root / "straight" / "t" / "metrics.jsonl")
    across = [r["comm_bytes_per_step"]["across_groups"] for r in records]
    assert len(across) == TRAIN_STEPS and sum(across) == straight["traffic"]["across_groups"]["bytes"] > 0
    # every step is reported, so its collectives are timed: each outer sync's record has its bandwidth
    # (the few kB of the metrics gather itself cross too, outside the step: counted, not timed)
    syncs = [r for r, sent in zip(records, across) if sent > 10_000]
    assert syncs and all(r["comm_gbit_s"]["across_groups"] > 0 for r in syncs)
    assert straight["traffic"]["across_groups"]["gbit_s"] > 0
    at_stop = [_group_tensors(root / "split", STOP_AT, g, tmp_path) for g in range(GROUPS)]
    weight = "model.layers.0.attention.wq.weight"
    assert not torch.equal(at_stop[0][weight], at_stop[1][weight])  # the groups were apart when it stopped
    saved = {key.split(".")[1] for key in at_stop[0] if key.startswith("outer.")}
    assert saved >= (
        {"agreed", "momentum", "arrived", "sent", "remainder"} if "streaming" in case else {"agreed", "momentum"}
    )
    for group in range(GROUPS):
        want = _group_tensors(root / "straight", TRAIN_STEPS, group, tmp_path)
        got = _group_tensors(root / "split", TRAIN_STEPS, group, tmp_path)
        assert got.keys() == want.keys() and any(k.endswith("exp_avg_sq") for k in want)
        for key in want:
            assert torch.equal(got[key], want[key]), f"group {group}: {key} differs after stop + resume"


def test_group_checkpoints_refuse_other_groups(runs: dict) -> None:
    to_plain, to_four = runs["refusals"][0]
    assert "holds 2 groups' weights" in to_plain and "plan.groups.count=2" in to_plain
    assert "this Plan has 4: use plan.groups.count=2" in to_four


def test_groups_start_from_a_checkpoint_of_one_model(runs: dict, train_roots: dict, tmp_path: Path) -> None:
    """A warm start (DiLoCo starts from a pretrained model): a plain run's step-2 checkpoint resumes under
    groups. Where DiLoCo reduces to synchronous SGD it ends where the plain run does; with H = 2 the outer
    loop's agreed weights, one step later and before any sync, are the checkpoint's weights in every group
    (a stale anchor, the weights built before the load, would make the first sync undo the warm start)."""
    straight, _, as_sync, _, anchored = runs["warm"][0]
    assert as_sync["resumed_from"].endswith(f"step_{2:08d}") and anchored["resumed_from"].endswith(f"step_{2:08d}")
    assert as_sync["last_loss"] == pytest.approx(straight["last_loss"], rel=1e-5)
    root = train_roots["warm"]
    want = checkpoint_tensors(ckpt(root / "straight", 4), tmp_path, prefixes=("model.",))
    start = checkpoint_tensors(ckpt(root / "anchor", 2), tmp_path, prefixes=("model.",))
    for group in range(GROUPS):
        got = _group_tensors(root / "as-sync", 4, group, tmp_path)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")
        outer = _group_tensors(root / "anchor", 3, group, tmp_path)
        assert not any(k.startswith("outer.momentum") for k in outer)
        for key, value in start.items():
            assert torch.equal(outer[key.replace("model.", "outer.agreed.", 1)], value), key
            assert not torch.equal(outer[key], value) or "norm" in key  # the group trained on after the start


def test_tessera_merge_judges_each_island_and_their_average_on_held_out_text(runs: dict, train_roots: dict) -> None:
    """The straight DiLoCo run ends between syncs (H = 3, step 8), so its two groups hold different
    models: merge judges each on the text after what the run read, which a plain loop here agrees with,
    and their average (the mean of the weights) and ensemble (the mean of the probabilities)."""
    from tessera.checkpoint.readers import CheckpointError
    from tessera.data.text import default_corpus
    from tessera.export import load_full_model_state
    from tessera.merge import merge
    from tessera.models import Llama, LlamaConfig

    checkpoint = ckpt(train_roots["diloco ddp int8"] / "straight", TRAIN_STEPS)
    report, average = merge([checkpoint], eval_bytes=8192)
    groups = [load_full_model_state(checkpoint / f"group_{g}") for g in range(GROUPS)]
    assert not torch.equal(groups[0]["layers.0.attention.wq.weight"], groups[1]["layers.0.attention.wq.weight"])
    for key, value in average.items():
        torch.testing.assert_close(value, (groups[0][key] + groups[1][key]) / 2)
    # the held-out text, read here: the corpus's bytes after the 60,000 the run trained on
    text = b"".join(Path(f).read_bytes() + b"\n" for f in default_corpus()[:200])[60_000 : 60_000 + 8192]
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    windows = tokens[: (len(tokens) - 1) // 32 * 32 + 1]
    x, y = windows[:-1].view(-1, 32), windows[1:].view(-1, 32)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32))
    for g, state in enumerate(groups):
        model.load_state_dict(state)
        with torch.no_grad():
            want = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
        assert report.tokens == y.numel() and abs(report.losses[f"step_{TRAIN_STEPS:08d}/group_{g}"] - want) < 1e-5
    assert report.losses["ensemble"] <= max(report.losses[f"step_{TRAIN_STEPS:08d}/group_{g}"] for g in range(2))
    with pytest.raises(CheckpointError, match="given twice"):
        merge([checkpoint, checkpoint])
    with pytest.raises(CheckpointError, match="tessera merge"):
        load_full_model_state(checkpoint)


def test_fragments_that_do_not_divide_the_layers_are_refused(runs: dict) -> None:
    for message in runs["fragments"]:
        assert "fragments=3 must divide the model's 2 layers" in message, message
