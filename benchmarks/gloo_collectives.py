"""gloo's collectives on the testbed: ZeRO-1's broadcasts against the cost model, and where FSDP's go.

The testbed of ``benchmarks/testbed_predictions.py``: four ranks a, a, b, c (CPU quotas
1 : 1 : ½ : ¼), 200 Mbit/s links, 50 Mbit/s between b and c; the demo model's real parameters.
Every figure is a median over ``--reps`` interleaved repetitions.

1. **ZeRO-1's gather** (``tessera/parallel/zero1.py``) ends every step with one broadcast per
   parameter piece from its owner. The cost model used to price it as a ring all-gather over the
   group's slowest link; gloo's broadcast is a binomial tree (``gloo/broadcast.cc``), so only some
   owners' trees cross the slow link. Timed: a ring all-reduce and a ring all-gather of all
   gradients, ZeRO-1's whole gather (``ShardedOptimizer._gather_params``) and each owner's
   broadcasts alone; beside them the cost model's figures from the links' shaped rates
   (``owner_broadcasts_s``: the tree; and the ring all-gather it replaced).
2. **FSDP (ZeRO-3) on gloo**: one rank's forward and backward at 8 samples with FSDP2, the same
   model unsharded (compute alone, per rank), and FSDP's collectives alone (one all-gather and one
   reduce-scatter per unit), back to back and each after the links idled ``IDLE_S`` (as a unit's
   compute idles them in a step): a shaped link's token bucket refills while it idles and passes its
   depth at once, which back-to-back collectives never see.

    sudo python benchmarks/gloo_collectives.py [--reps 5] [--json docs/gloo_collectives.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from testbed_cluster import SEQ, cluster_spec, config  # noqa: E402

RESULT_ENV = "GLOO_COLLECTIVES_RESULT"
FSDP_SAMPLES = 8  # per rank, as ZeRO-3 ×4 takes them in benchmarks/testbed_predictions.py
IDLE_S = 0.05  # before each collective "after idle": longer than the slow link's bucket takes to refill


def demo_model():
    from tessera.config import load_config
    from tessera.models.build import build_model

    path = Path(tempfile.mkdtemp(prefix="gloo-collectives-")) / "model.yaml"
    path.write_text(yaml.safe_dump(config(path.parent, {"preset": "ddp"}, 1, "probe")))
    return build_model(load_config(str(path), []))


def timed(run, reps: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        run()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def zero1_part(reps: int) -> dict:
    """Part 1 on every rank: each pattern's median seconds (interleaved)."""
    import torch
    import torch.distributed as dist

    from tessera.parallel.zero1 import ShardedOptimizer

    world = dist.get_world_size()
    params = list(demo_model().parameters())
    sharded = ShardedOptimizer([{"params": params}], lambda groups: torch.optim.SGD(groups, lr=0.0), dist.group.WORLD)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = torch.empty(flat.numel() // world * world)

    def owner(r: int):
        def run() -> None:
            pending = []
            for s in sharded.slices:
                view = s.full.detach().view(-1)
                pending += [dist.broadcast(view[lo:hi], src=r, async_op=True) for o, lo, hi in s.owners if o == r]
            for work in pending:
                work.wait()

        return run

    patterns = {
        "ring all-reduce": lambda: dist.all_reduce(flat),
        "ring all-gather": lambda: dist.all_gather_into_tensor(gathered, flat[: gathered.numel() // world]),
        "ZeRO-1 gather": sharded._gather_params,
        **{f"owner {r} alone": owner(r) for r in range(world)},
    }
    runs: dict[str, list[float]] = {name: [] for name in patterns}
    for _ in range(reps):
        for name, run in patterns.items():
            runs[name].append(timed(run, 1))
    return {
        "bytes": 4 * flat.numel(),
        "tensors": len(params),
        "pieces": sum(len(s.owners) for s in sharded.slices),
        "measured_s": {k: statistics.median(v) for k, v in runs.items()},
        "runs_s": runs,
    }


def fsdp_part(reps: int) -> dict:
    """Part 2 on every rank: FSDP2 forward/backward, the unsharded model's, and the collectives alone."""
    import torch
    import torch.distributed as dist

    import tessera

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = demo_model()
    units = 1 + sum(1 for _ in model.layers)  # every block, and the root
    n_params = sum(p.numel() for p in model.parameters())
    sharded, _ = tessera.Booster(tessera.ZeRO(stage=3)).boost(model, torch.optim.SGD(model.parameters(), lr=0.0))
    plain = demo_model()
    x = torch.randint(0, 256, (FSDP_SAMPLES, SEQ))
    per_unit = n_params // units // world * world
    shard, full, grads, out = (torch.ones(per_unit // world), torch.empty(per_unit), torch.ones(per_unit),
                               torch.empty(per_unit // world))  # fmt: skip
    figures: dict[str, list[float]] = {k: [] for k in ("fsdp forward", "fsdp backward", "plain forward",
                                                       "plain backward", "gathers", "reduce-scatters",
                                                       "gathers after idle", "reduce-scatters after idle")}  # fmt: skip

    def after_idle(run) -> float:
        """Seconds ``run`` took, summed over the units, each started once every link idled ``IDLE_S``."""
        dist.barrier()
        total = 0.0
        for _ in range(units):
            time.sleep(IDLE_S)
            start = time.perf_counter()
            run()
            total += time.perf_counter() - start
        return total

    for rep in range(reps + 1):  # the first is a warm-up
        got = {}
        for name, net in (("fsdp", sharded), ("plain", plain)):
            dist.barrier()
            start = time.perf_counter()
            loss = net(x).float().mean()
            middle = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            got[f"{name} forward"], got[f"{name} backward"] = middle - start, end - middle
        got["gathers"] = timed(lambda: [dist.all_gather_into_tensor(full, shard) for _ in range(units)], 1)
        got["reduce-scatters"] = timed(lambda: [dist.reduce_scatter_tensor(out, grads) for _ in range(units)], 1)
        got["gathers after idle"] = after_idle(lambda: dist.all_gather_into_tensor(full, shard))
        got["reduce-scatters after idle"] = after_idle(lambda: dist.reduce_scatter_tensor(out, grads))
        if rep:
            for k, v in got.items():
                figures[k].append(v)
    return {"units": units, "unit_bytes": 4 * per_unit, **{k: statistics.median(v) for k, v in figures.items()}}


def rank_main(reps: int) -> None:
    """One testbed rank: both parts; rank 0 writes what every rank measured."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {"zero1": zero1_part(reps), "fsdp": fsdp_part(reps)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        out = {**every[0]["zero1"], "fsdp_per_rank": [r["fsdp"] for r in every]}
        Path(os.environ[RESULT_ENV]).write_text(json.dumps(out))
    dist.destroy_process_group()


def predictions(spec: dict, grad_bytes: float) -> dict[str, float]:
    """The cost model's figures for the same bytes from the cluster file's (shaped) link rates."""
    from dataclasses import replace

    from tessera.cluster.spec import Cluster
    from tessera.planner.layout import Layout, gloo_owner_turns_s, links_among, owner_broadcasts_s

    cluster = Cluster.from_dict(spec)
    members = ("a", "a", "b", "c")
    node_links = tuple((a, b, replace(link, backend="gloo")) for a, b, link in links_among(cluster, [members]))
    slowest = replace(cluster.worst_link(set(members)), backend="gloo")
    layout = Layout(1, 4, 1, ((0, 1),), 1, "1f1b", 1, False, "none", (), (slowest,), (), node_links, (members,))
    turns = gloo_owner_turns_s(members, node_links, grad_bytes / 4)
    return {
        "ring all-reduce": slowest.all_reduce_s(grad_bytes, 4, calls=0),
        "ring all-gather": slowest.all_reduce_s(grad_bytes, 4, calls=0) / 2,
        "ZeRO-1 gather": owner_broadcasts_s(layout, 0, grad_bytes),
        **{f"owner {r} alone": t for r, t in enumerate(turns)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpus", type=float, default=1.65)
    ap.add_argument("--link-mbit", type=float, default=200.0)
    ap.add_argument("--slow-link-mbit", type=float, default=50.0)
    ap.add_argument("--json")
    args = ap.parse_args()

    from tessera.cluster.spec import Cluster
    from tessera.testbed import Testbed
    from tessera.testbed.testbed import ENTER_SCRIPT

    spec = cluster_spec(args.link_mbit, args.slow_link_mbit)
    work = Path(tempfile.mkdtemp(prefix="gloo-collectives-"))
    result = work / "result.json"
    with Testbed(Cluster.from_dict(spec), [0, 1, 2, 3], args.cpus) as bed:
        print(bed.describe())
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parent.parent)]),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            RESULT_ENV: str(result),
            "GLOO_COLLECTIVES_REPS": str(args.reps),
        }
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={work / 'rendezvous'}", "--rdzv-conf=store_type=file",
             f"--local-addr={bed.master_addr}", str(ENTER_SCRIPT), str(bed.seats_file), "gloo_collectives"],
            env=env,
        )  # fmt: skip
    # About one run in three a rank aborts as it exits ("terminate called without an active exception", from
    # gloo's threads at teardown), after rank 0 wrote what every rank measured: the figures stand.
    if not result.is_file():
        raise SystemExit("the ranks failed before writing their figures: see the log above")
    measured = json.loads(result.read_text())
    predicted = predictions(spec, measured["bytes"])
    print(f"1. {measured['bytes']:,} bytes of parameters, {measured['tensors']} tensors, {measured['pieces']} pieces")
    print(f"{'pattern':18s} {'measured':>9s} {'predicted':>9s}")
    for name, seconds in measured["measured_s"].items():
        error = predicted[name] / seconds - 1
        print(f"{name:18s} {seconds * 1e3:7.0f} ms {predicted[name] * 1e3:7.0f} ms  ({error:+.0%})")
    print(f"2. FSDP (ZeRO-3) at {FSDP_SAMPLES} samples a rank, seconds")
    for rank, row in enumerate(measured["fsdp_per_rank"]):
        cells = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float))
        print(f"rank {rank}: {cells}")
    if args.json:
        out = {**vars(args), **measured, "predicted_s": predicted}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # started by torchrun inside the testbed
        rank_main(int(os.environ.get("GLOO_COLLECTIVES_REPS", "5")))
    else:
        main()
