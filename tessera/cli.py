"""The ``tessera`` command.

    tessera train CONFIG.yaml [--set optimizer.lr=3e-4 ...] [--nproc N]   config-driven training (via torchrun)
    tessera plan --model CONFIG.yaml --cluster C.yaml --global-batch B    best plans, a Plan file and a picture
    tessera plan check PLAN.yaml --world-size N                           validate a Plan file for N ranks
    tessera export CHECKPOINT --out model.safetensors [--hf-dir DIR]      full model from any layout's checkpoint

Bad input prints one ``tessera: error: ...`` paragraph and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from tessera.errors import PlanError

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _plan_check(args: argparse.Namespace) -> int:
    from tessera.plan import Plan

    plan = Plan.load(args.file).resolve(args.world_size)
    print(plan.to_yaml(), end="")
    print(f"# valid for {args.world_size} ranks")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Plan a training config's model on a cluster: table, Plan file, picture."""
    import torch

    from tessera.cluster.spec import Cluster
    from tessera.planner import ModelCosts
    from tessera.planner.draw import draw
    from tessera.planner.search import search
    from tessera.train.config import load_config
    from tessera.train.trainer import build_model

    if not (args.model and args.cluster and args.global_batch):
        raise ValueError("tessera plan needs --model CONFIG.yaml --cluster CLUSTER.yaml --global-batch N.")
    cfg = load_config(args.model, [])
    cluster = Cluster.load(args.cluster)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = build_model(cfg)
    costs = ModelCosts.from_model(model, cfg.data.seq_len, cfg.plan.precision)
    found = search(cluster, costs, args.global_batch, top=args.top)
    print(
        f"{len(found)} best plans for {costs.name} ({costs.source} costs, seq {costs.seq_len}, {costs.precision}) "
        f"on {cluster.world_size} devices, global batch {args.global_batch}:"
    )
    print(
        f"{'#':>2} {'s/step':>9} {'tokens/s':>11} {'dp':>3} {'tp':>3} {'pp':>3} {'zero':>4} {'mb':>3} "
        f"{'recompute':>9} {'mem':>5}  placement / bottleneck"
    )
    for i, c in enumerate(found):
        p, e = c.plan, c.estimate
        fullest = max(m.total / m.capacity for m in e.memory)
        dp, pp = (len(p.replicas), "mix") if p.replicas else (p.dp, p.pp)
        print(
            f"{i:>2} {e.step_s:>9.4g} {e.tokens_per_s:>11,.0f} {dp:>3} {p.tp:>3} {pp:>3} {p.zero:>4} "
            f"{p.pipeline.microbatches:>3} {p.recompute:>9} {fullest:>5.0%}  {c.placement}; {e.bottleneck}"
        )
        if p.replicas:
            print(f"{'':>3} replicas (share: stages) " + "; ".join(f"{r.share}: {list(r.stages)}" for r in p.replicas))
        elif p.dp_shares or p.pipeline.stages:
            print(f"{'':>3} shares {p.dp_shares or 'even'}; stages {p.pipeline.stages or 'one'}")
    best = found[0]
    _print_launch(best.plan, cluster)
    best.plan.save(args.out)
    print(f"wrote {args.out} (plan 0; mem = fullest device's share of its usable memory)")
    print(f"wrote {draw(best, cluster, costs, args.png)}")
    return 0


def _print_launch(plan, cluster) -> None:
    """Which --node-rank each machine gets: plan 0's ranks take each node's devices in turn."""
    if len(cluster.nodes) == 1:
        return
    devices = cluster.devices()
    order: list[str] = []
    for rank in range(len(devices)):
        node = devices[plan.device_of(rank)][0]
        if not order or order[-1] != node:
            order.append(node)
    launch = ", ".join(
        f"{node} --node-rank {k} --nproc-per-node {cluster.node(node).count}" for k, node in enumerate(order)
    )
    print(f"launch plan 0 with torchrun --nnodes {len(order)}: {launch}")


def _validate_training(args: argparse.Namespace) -> None:
    """Everything that can be checked before any process starts or any file is written."""
    from tessera.data.text import check_corpus_size, resolve_paths
    from tessera.train.config import ConfigError, load_config, plan_from_config

    cfg = load_config(args.config, args.overrides)
    world = args.nproc * args.nnodes
    try:
        plan = plan_from_config(cfg.plan).resolve(world)
        from tessera.data.sharding import split_batch

        split_batch(cfg.train.global_batch_size, plan.shares())
    except PlanError as exc:
        raise ConfigError(f"plan (for {world} ranks): {exc}") from None
    check_corpus_size(resolve_paths(cfg.data.paths), cfg.data.seq_len, cfg.data.max_bytes)  # sizes only: ranks read


def _train(args: argparse.Namespace) -> int:
    _validate_training(args)
    run_args = [args.config, *(f"--set={o}" for o in args.overrides)]
    if "LOCAL_RANK" in os.environ:  # already a torchrun/SLURM-launched rank
        from tessera.train.run import main as run_main

        return run_main(run_args)
    launch = [f"--nproc-per-node={args.nproc}", f"--max-restarts={args.max_restarts}"]
    if args.nnodes > 1 or args.rdzv_endpoint:
        launch += [
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.rdzv_endpoint}",
            f"--rdzv-id={args.rdzv_id}",
        ]
    else:
        launch += ["--standalone"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # reliable restarts (design brief, trap 3)
    proc = subprocess.run(
        [*TORCHRUN, *launch, "-m", "tessera.train.run", *run_args], env=env, stderr=subprocess.PIPE, text=True
    )
    if proc.returncode:
        ours = [line for line in proc.stderr.splitlines() if line.startswith("tessera: error:")]
        print(ours[0] if ours else proc.stderr[-4000:], file=sys.stderr)
        return 2 if ours else proc.returncode
    return 0


def _export(args: argparse.Namespace) -> int:
    from tessera.export import export_hf, export_safetensors

    if not args.out and not args.hf_dir:
        raise ValueError("tessera export needs --out FILE.safetensors and/or --hf-dir DIR.")
    if args.out:
        print(f"wrote {export_safetensors(args.checkpoint, args.out)}")
    if args.hf_dir:
        print(f"wrote {export_hf(args.checkpoint, args.hf_dir)}")
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from tessera.cluster.spec import Cluster

    if args.cluster_command == "detect":
        from tessera.cluster.detect import describe, detect

        text = describe(detect(args.name))
        if args.out:
            Path(args.out).write_text(text)
            print(f"wrote {args.out}")
        else:
            print(text, end="")
        return 0
    cluster = Cluster.load(args.file)
    for node in cluster.nodes:
        t = cluster.device_type(node.name)
        peaks = ", ".join(f"{k} {v:g}" for k, v in t.peak_tflops.items())
        print(f"{node.name} ({node.region}): {node.count} x {t.name}, {t.memory_gib:g} GiB, {peaks} TFLOP/s")
    print(f"# valid: {cluster.world_size} devices on {len(cluster.nodes)} nodes")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tessera", description="Scale PyTorch training with one Plan.")
    sub = ap.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML config (launches torchrun)")
    train.add_argument("config")
    train.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set plan.zero=3",
    )
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    train.add_argument("--nproc", type=int, default=2, help="ranks per node")
    train.add_argument("--nnodes", type=int, default=1)
    train.add_argument("--rdzv-endpoint", default="", help="host:port of the rendezvous (multi-node)")
    train.add_argument("--rdzv-id", default="tessera")
    train.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a rank fails")
    train.add_argument("--emulate", help="a cluster file whose devices the local ranks play (slowed, memory-checked)")
    plan = sub.add_parser("plan", help="plan a model on a cluster, or check a Plan file")
    plan.add_argument("--model", help="a training config (its model:, data.seq_len and plan.precision are read)")
    plan.add_argument("--cluster", help="a cluster file (tessera cluster detect writes one)")
    plan.add_argument("--global-batch", type=int, help="samples per optimizer step")
    plan.add_argument("--top", type=int, default=5, help="how many plans to list")
    plan.add_argument("--out", default="plan.yaml", help="where to write the best Plan")
    plan.add_argument("--png", default="plan.png", help="where to draw devices by stage and the simulated timeline")
    plan_sub = plan.add_subparsers(dest="plan_command")
    check = plan_sub.add_parser("check", help="validate a Plan file")
    check.add_argument("file")
    check.add_argument("--world-size", type=int, required=True)
    cluster = sub.add_parser("cluster", help="describe clusters: detect this machine, check a cluster file")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    detect = cluster_sub.add_parser("detect", help="write a cluster file for this machine")
    detect.add_argument("--out", help="file to write (default: print it)")
    detect.add_argument("--name", help="node name (default: the host name)")
    cluster_check = cluster_sub.add_parser("check", help="validate a cluster file and list its devices")
    cluster_check.add_argument("file")
    export = sub.add_parser("export", help="write a checkpoint's full model as safetensors / Hugging Face")
    export.add_argument("checkpoint")
    export.add_argument("--out", help="a .safetensors file to write")
    export.add_argument("--hf-dir", help="a directory for save_pretrained (Hugging Face models)")
    args = ap.parse_args(argv)
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "cluster":
            return _cluster(args)
        if args.command == "train":
            if args.resume:
                args.overrides.append("checkpoint.resume=auto")
            if args.emulate:  # read by every rank's Booster (tessera.cluster.emulate)
                os.environ["TESSERA_EMULATE"] = str(Path(args.emulate).resolve())
            return _train(args)
        return _plan_check(args) if args.plan_command == "check" else _plan(args)
    except (ValueError, FileNotFoundError) as exc:  # PlanError, ConfigError, CheckpointError are ValueErrors
        print(f"tessera: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
