"""Two regions joined by a slow link, on the testbed: flat, hierarchical, DiLoCo and Streaming DiLoCo.

Two nodes of two ranks each, a real 20 Mbit/s link between them (veth pairs shaped with ``tc tbf``)
and CPU quotas for the four ranks. Every layout trains the demo Llama on the standard library's
text through ``tessera train --testbed``, with the same tokens, seed and schedule:

- *flat*: DDP over all four ranks, the gradients all-reduced across the link every step;
- *hierarchical*: ``groups: {count: 2, sync: every_step}``, a node each: reduce-scatter inside, the
  slices across, all-gather inside;
- *DiLoCo H*: ``sync: diloco`` with ``inner_steps`` H (outer Nesterov SGD lr 0.7, momentum 0.9),
  also with int8 outer gradients;
- *average*: DiLoCo's schedule with outer SGD lr 1 and no momentum: the groups' weights averaged;
- *streaming*: ``sync: streaming``, the model's 4 layers in 2 fragments synced in turn, each
  landing a step after it leaves.

Reported per layout (median over seeds): the held-out loss of the final model (``tessera merge``
on the last checkpoint: the text after what the run read; the groups' average where they hold
two models), the bytes of collectives spanning the two nodes (tessera.traffic's count, summed over
ranks) and the bytes the kernel saw cross the link (the testbed's veth counters, both ways),
the largest count in one step (streaming's peak vs DiLoCo's), and the training wall-clock (steps ×
tokens / the run's tokens/s: set-up excluded). Runs are interleaved: seed after seed, every layout.

    sudo python benchmarks/cross_region.py [--seeds 0 1 2] [--steps 200] [--json docs/cross_region.json]

``--loopback`` trains the same layouts without the testbed (no cgroups, no shaped link, no root):
the same computation, so the same losses, for runs too long for the 20 Mbit/s link (flat takes
2.7 s a step there); its bytes never touch a wire and its seconds say nothing about the link.

    python benchmarks/cross_region.py --loopback --steps 2000 --layouts flat "DiLoCo H=50" --json out.json

``--warm-start W`` starts every layout from a synchronous run's step W, as the DiLoCo paper starts its
replicas from a pretrained model: per seed, flat DDP trains the first W of ``W + steps`` steps (the
schedule of the whole run) and checkpoints; each layout resumes a copy of it (a checkpoint of one
model starts every group) for ``--steps`` more, and its bytes and seconds count those steps only.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from testbed_cluster import tessera  # noqa: E402  (runs `tessera ...`, exits with its stderr on failure)

LINK_MBIT = 20.0
CPUS = 1.6  # of the machine's 2 cores: 0.4 a rank, the rest for the harness and the kernel
MODEL = {"dim": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 384}  # examples/demo.yaml's
SEQ, BATCH = 128, 16
TRAIN_BYTES = 1_000_000  # read for training; the held-out text follows it
EVAL_BYTES = 1 << 17


def groups(sync: str, **more: Any) -> dict:
    return {"count": 2, "sync": sync, **more}


LAYOUTS: dict[str, dict] = {
    "flat": {"preset": "ddp"},
    "hierarchical": {"preset": "ddp", "groups": groups("every_step")},
    "DiLoCo H=10": {"preset": "ddp", "groups": groups("diloco", inner_steps=10)},
    "DiLoCo H=50": {"preset": "ddp", "groups": groups("diloco", inner_steps=50)},
    "DiLoCo H=100": {"preset": "ddp", "groups": groups("diloco", inner_steps=100)},
    "DiLoCo H=50 int8": {"preset": "ddp", "groups": groups("diloco", inner_steps=50, compression="int8")},
    "DiLoCo H=50 bf16": {"preset": "ddp", "groups": groups("diloco", inner_steps=50, compression="bf16")},
    # plain model averaging every 50 steps (outer SGD, lr 1, no momentum): is it the outer optimizer?
    "average H=50": {
        "preset": "ddp",
        "groups": groups("diloco", inner_steps=50, outer_lr=1.0, outer_momentum=0.0, nesterov=False),
    },
    "streaming H=50 F=2": {"preset": "ddp", "groups": groups("streaming", inner_steps=50, fragments=2, delay=1)},
    # the outer optimizer's two knobs, for the loss gap (run with --loopback)
    "DiLoCo H=50 outer lr 1.0": {"preset": "ddp", "groups": groups("diloco", inner_steps=50, outer_lr=1.0)},
    "DiLoCo H=50 outer lr 0.4": {"preset": "ddp", "groups": groups("diloco", inner_steps=50, outer_lr=0.4)},
    "DiLoCo H=50 momentum 0.5": {"preset": "ddp", "groups": groups("diloco", inner_steps=50, outer_momentum=0.5)},
}
# Each group's AdamW sees half the flat run's batch: does its learning rate want scaling (for the loss gap)?
# Flat's too, so that the comparison is with flat at its own best rate.
INNER_LR: dict[str, float] = {}
for factor in (0.5, 0.7, 1.4, 2.0, 2.8):
    for base in ("flat", "DiLoCo H=50", "average H=50"):
        LAYOUTS[f"{base} lr x{factor}"] = LAYOUTS[base]
        INNER_LR[f"{base} lr x{factor}"] = factor
LR = 3e-3
FRAGMENTS = 2


def cluster_spec() -> dict:
    link = {"bandwidth_gbs": LINK_MBIT / 8e3, "latency_us": 100}
    return {
        "nodes": [
            {"name": "region-a", "devices": [{"type": "cpu", "count": 2}]},
            {"name": "region-b", "devices": [{"type": "cpu", "count": 2}]},
        ],
        "device_types": {"cpu": {"peak_tflops": {"fp32": 1}, "memory_gib": 8, "bandwidth_gbs": 10}},
        "links": {"inter_node": link, "inter_region": link},
    }


def config(
    out_dir: Path, name: str, plan: dict, steps: int, seed: int, train_bytes: int = TRAIN_BYTES, lr: float = LR
) -> dict:
    return {
        "model": MODEL,
        "data": {"seq_len": SEQ, "max_bytes": train_bytes},
        "optimizer": {"name": "adamw", "lr": lr, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 10},
        "plan": plan,
        "train": {
            "steps": steps,
            "global_batch_size": BATCH,
            "seed": seed,
            "log_every": 1,
            "sample_bytes": 0,
            "timeout_s": 900,
        },
        "checkpoint": {"every": 0, "resume": "never"},
        "logging": {"run_name": name, "out_dir": str(out_dir), "progress": False, "tensorboard": False},
    }


def run(
    work: Path, cluster: Path | None, layout: str, steps: int, seed: int, train_bytes: int = TRAIN_BYTES,
    warm: int = 0,
) -> dict[str, float]:  # fmt: skip
    """One `tessera train --testbed` run (loopback when ``cluster`` is None) and its figures. ``warm`` > 0:
    the run continues the seed's synchronous warm-up (:func:`warm_up`) from its step ``warm`` for ``steps``
    more; its figures count those steps only."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{layout}-s{seed}")
    cfg_file = work / f"{name}.yaml"
    lr = LR * INNER_LR.get(layout, 1.0)
    cfg = config(work / "runs", name, LAYOUTS[layout], warm + steps, seed, train_bytes, lr)
    again = ["--overwrite"]
    if warm:  # a copy of the warm-up's run directory, continued under this layout
        shutil.rmtree(work / "runs" / name, ignore_errors=True)
        shutil.copytree(work / "runs" / f"warm-up-s{seed}", work / "runs" / name)
        again = ["--resume"]
    cfg_file.write_text(yaml.safe_dump(cfg))
    started = time.perf_counter()
    out = _train(cfg_file, cluster, *again)
    run_s = time.perf_counter() - started
    records = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step" in r and "event" not in r and r["step"] > warm]
    across = [r["comm_bytes_per_step"]["inter_node"] + r["comm_bytes_per_step"]["across_groups"] for r in records]
    wire = sum(int(n.replace(",", "")) for n in re.findall(r"link region-\S+ -> region-\S+: ([\d,]+) bytes", out))
    checkpoint = work / "runs" / name / "checkpoints" / f"step_{warm + steps:08d}"
    losses = json.loads(_merge(checkpoint, work / f"{name}-merge.json"))["held_out_loss"]
    return {
        "held_out_loss": losses["average"],
        "counted_bytes_across": sum(across),
        "kernel_bytes_across": wire,
        "peak_step_bytes_across": max(across),
        "train_s": steps * BATCH * SEQ / records[-1]["tokens_per_s"],
        "run_s": run_s,
        "final_train_loss": records[-1]["loss"],
    }


def warm_up(work: Path, cluster: Path | None, warm: int, steps: int, seed: int, train_bytes: int) -> None:
    """Flat DDP over all four ranks for the first ``warm`` of ``warm + steps`` steps (the schedule of the whole
    run), checkpointed there: every layout of the seed continues from it (DiLoCo starts from a trained model)."""
    name = f"warm-up-s{seed}"
    cfg = config(work / "runs", name, LAYOUTS["flat"], warm + steps, seed, train_bytes)
    cfg["train"]["stop_at"] = warm
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    _train(work / f"{name}.yaml", cluster, "--overwrite")


def _train(cfg_file: Path, cluster: Path | None, *more: str) -> str:
    """`tessera train` on the four ranks, on the testbed of ``cluster`` (loopback when None); its output."""
    testbed = ["--testbed", str(cluster), "--testbed-cpus", str(CPUS)] if cluster is not None else []
    return tessera("train", str(cfg_file), "--nproc", "4", *testbed, *more)


def _merge(checkpoint: Path, out: Path) -> str:
    tessera("merge", str(checkpoint), "--eval-bytes", str(EVAL_BYTES), "--json", str(out), "--force")
    return out.read_text()


def sync_check(work: Path) -> dict[str, dict[str, float]]:
    """The planner's outer-level cost of one sync across the link (tessera.planner.outer, from the cluster
    file's 20 Mbit/s) next to what the runs under ``work`` measured: for DiLoCo, the median step that
    syncs minus the median step that does not (steps 3.. of every seed); for every-step sync, the
    hierarchical step minus DiLoCo H=50's median step that does not sync."""
    from tessera.cluster.spec import Cluster
    from tessera.config import parse_config
    from tessera.models.build import build_model
    from tessera.planner.outer import sync_seconds

    cluster = Cluster.from_dict(cluster_spec())
    predict = sync_seconds(cluster, [[cluster.nodes[0]], [cluster.nodes[1]]])
    cfg = parse_config(config(work, "x", {"preset": "ddp"}, 1, 0))
    import torch

    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(cfg).parameters())
    steps: dict[str, list[float]] = {}
    sync: dict[str, list[float]] = {}
    for metrics in sorted((work / "runs").glob("*/metrics.jsonl")):
        layout = next(
            (name for name in LAYOUTS if metrics.parent.name.startswith(re.sub(r"[^A-Za-z0-9_.-]", "_", name) + "-s")),
            None,
        )
        if layout is None:
            continue
        h = (
            LAYOUTS[layout].get("groups", {}).get("inner_steps")
            if LAYOUTS[layout].get("groups", {}).get("sync") == "diloco"
            else None
        )
        for r in (json.loads(line) for line in metrics.read_text().splitlines()):
            if "step_time_s" not in r or r["step"] < 3:
                continue
            (sync if h and r["step"] % h == 0 else steps).setdefault(layout, []).append(r["step_time_s"])
    out = {}
    inner = statistics.median(steps["DiLoCo H=50"]) if "DiLoCo H=50" in steps else None
    for layout, times in sync.items():
        if LAYOUTS[layout]["groups"].get("compression"):  # the planner prices uncompressed syncs only
            continue
        out[layout] = {
            "predicted_s": predict(4 * params),
            "measured_s": statistics.median(times) - statistics.median(steps[layout]),
        }
    if inner is not None and "hierarchical" in steps:
        out["hierarchical"] = {
            "predicted_s": predict(4 * params),
            "measured_s": statistics.median(steps["hierarchical"]) - inner,
        }
    return out


def summarise(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    flat = {k: statistics.median(r[k] for r in runs["flat"]) for k in runs["flat"][0]}
    table = {}
    for layout, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        table[layout] = {
            "runs": results,
            "median": med,
            "bytes_vs_flat": (  # on loopback flat's ranks share a host: nothing of it counts as across
                flat["counted_bytes_across"] / med["counted_bytes_across"] if med["counted_bytes_across"] else None
            ),
            "kernel_bytes_vs_flat": (  # none on loopback: no wire
                flat["kernel_bytes_across"] / med["kernel_bytes_across"] if med["kernel_bytes_across"] else None
            ),
            "loss_vs_flat": med["held_out_loss"] / flat["held_out_loss"] - 1,
            "speedup_vs_flat": flat["train_s"] / med["train_s"],
        }
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--loopback", action="store_true", help="no testbed: the same losses, for long runs")
    ap.add_argument(
        "--train-bytes", type=int, default=TRAIN_BYTES, help="text read for training; the held-out text follows"
    )
    ap.add_argument(
        "--warm-start", type=int, default=0, metavar="STEPS",
        help="every layout continues a flat run's first STEPS steps (the same per seed) for --steps more",
    )  # fmt: skip
    ap.add_argument(
        "--add-to", type=Path, metavar="JSON", help="an earlier run's --json: its runs join these (flat's too)"
    )
    ap.add_argument(
        "--sync-check", type=Path, metavar="WORK", help="compare a finished run folder's syncs with the planner's"
    )
    args = ap.parse_args()
    if args.sync_check:
        for layout, row in sync_check(args.sync_check).items():
            print(f"{layout:<20} one sync: predicted {row['predicted_s']:.3f} s, measured {row['measured_s']:.3f} s")
        return
    work = Path(tempfile.mkdtemp(prefix="tessera-cross-region-"))
    cluster: Path | None = None if args.loopback else work / "cluster.yaml"
    if cluster is not None:
        cluster.write_text(yaml.safe_dump(cluster_spec()))
    runs: dict[str, list[dict[str, float]]] = {layout: [] for layout in args.layouts}
    for seed in args.seeds:
        if args.warm_start:
            warm_up(work, cluster, args.warm_start, args.steps, seed, args.train_bytes)
        for layout in args.layouts:
            result = run(work, cluster, layout, args.steps, seed, args.train_bytes, args.warm_start)
            runs[layout].append(result)
            print(f"seed {seed} {layout}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()), flush=True)
    if args.add_to:  # earlier layouts (and their work folder, for the sync check) join this run's
        earlier = json.loads(args.add_to.read_text())
        runs = {**{layout: row["runs"] for layout, row in earlier["layouts"].items() if layout not in runs}, **runs}
    table = summarise(runs)
    print(f"\n{'layout':<20} {'held-out':>9} {'vs flat':>8} {'MB across':>10} {'kernel MB':>10} {'x fewer':>8} "
          f"{'peak MB':>8} {'train s':>8} {'x faster':>9}")  # fmt: skip
    for layout, row in table.items():
        m = row["median"]
        print(
            f"{layout:<20} {m['held_out_loss']:>9.4f} {row['loss_vs_flat']:>+8.1%} "
            f"{m['counted_bytes_across'] / 1e6:>10.1f} {m['kernel_bytes_across'] / 1e6:>10.1f} "
            f"{row['bytes_vs_flat'] or 0:>8.1f} {m['peak_step_bytes_across'] / 1e6:>8.2f} {m['train_s']:>8.1f} "
            f"{row['speedup_vs_flat']:>9.2f}"
        )
    checks = {**(json.loads(args.add_to.read_text()).get("sync_check", {}) if args.add_to else {})}
    if not args.loopback:  # on loopback no step waits for a link
        checks.update(sync_check(work))
    for layout, row in checks.items():
        print(f"{layout:<20} one sync: predicted {row['predicted_s']:.3f} s, measured {row['measured_s']:.3f} s")
    if args.json:
        meta = {"link_mbit": None if args.loopback else LINK_MBIT, "cpus": None if args.loopback else CPUS,
                "steps": args.steps, "seeds": args.seeds, "fragments": FRAGMENTS,
                "train_bytes": args.train_bytes, "warm_start": args.warm_start}  # fmt: skip
        args.json.write_text(
            json.dumps({"setup": meta, "layouts": table, "sync_check": checks, "work": str(work)}, indent=1)
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
