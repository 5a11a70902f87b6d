"""The ``tessera`` command.

    tessera train CONFIG.yaml [--set optimizer.lr=3e-4 ...] [--nproc N]   config-driven training (via torchrun)
    tessera plan --model CONFIG.yaml --cluster C.yaml --global-batch B    best plans, a Plan file and a picture
    tessera plan check PLAN.yaml --world-size N                           validate a Plan file for N ranks
    tessera cluster profile CONFIG.yaml --cluster C.yaml [--testbed]      measure devices and links for the planner
    tessera testbed clean                                                 remove what a killed testbed left
    tessera export CHECKPOINT --out model.safetensors [--hf-dir DIR]      full model from any layout's checkpoint
    tessera merge CHECKPOINT... [--out merged.safetensors]                islands' held-out losses, averaged, ensembled

Every failure prints one ``tessera: error: ...`` paragraph. Exit codes: 2 bad input, 3 a collective
timed out (a rank died or hung), 4 a runtime fault (out of memory, disk full, a crashed rank),
130 interrupted (see :mod:`tessera.train.failures`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from tessera.inputs import check_output_file
from tessera.train.failures import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RUNTIME_FAULT


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one ``tessera: error:`` paragraph (exit 2) like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"tessera: error: {self.prog}: {message} (see: {self.prog} --help)\n")


def _count(minimum: int):
    """An argparse type: a whole number >= ``minimum``, refused with the flag's name otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


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
    from tessera.planner import ModelCosts, plan_for
    from tessera.planner.draw import draw
    from tessera.planner.precision import choose_precision
    from tessera.train.build import build_model
    from tessera.train.config import load_config, plan_from_config

    if not (args.model and args.cluster and args.global_batch):
        raise ValueError("tessera plan needs --model CONFIG.yaml --cluster CLUSTER.yaml --global-batch N.")
    cfg = load_config(args.model, [])
    cluster = Cluster.load(args.cluster)
    check_output_file(args.out, "--out", force=True)  # plan files are outputs: rewritten, but must be writable
    check_output_file(args.png, "--png", force=True)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = build_model(cfg)
    requested = args.precision or plan_from_config(cfg.plan).precision
    precision, precision_note = choose_precision(cluster, requested, args.pin_precision)
    costs = ModelCosts.from_model(model, cfg.data.seq_len, precision)
    if args.profile:  # plan from what `tessera cluster profile` measured, not from declared figures
        from tessera.planner.live_profile import LiveProfile, measured_cluster, measured_costs

        live = LiveProfile.load(args.profile)
        cluster, costs = measured_cluster(cluster, live), measured_costs(live, costs)
    found = plan_for(
        cluster, model, args.global_batch, precision=precision, top=args.top, costs=costs, pin_precision=True
    )  # the precision is settled above (with its note on the best candidate when it was chosen)
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
        own = p.groups is not None and p.groups.layouts is not None  # each group its own layout: lines below
        dp, pp = (len(p.replicas), "mix") if p.replicas else ("-", "-") if own else (p.dp, p.pp)
        tp, zero, mb, rc = ("-",) * 4 if own else (p.tp, p.zero, p.pipeline.microbatches, p.recompute)
        print(
            f"{i:>2} {e.step_s:>9.4g} {e.tokens_per_s:>11,.0f} {dp:>3} {tp:>3} {pp:>3} {zero:>4} "
            f"{mb:>3} {rc:>9} {fullest:>5.0%}  {c.placement}; {e.bottleneck}"
        )
        if own:
            assert p.groups is not None
            for g in range(p.groups.count):
                q = p.group_plan(g)
                print(
                    f"{'':>3} group {g}: {(p.groups.sizes or ())[g]} ranks, {(p.groups.shares or ())[g]} samples: "
                    f"tp{q.tp} pp{q.pp} ZeRO-{q.zero} m{q.pipeline.microbatches} recompute {q.recompute}, shares "
                    f"{q.dp_shares or 'even'}"
                )  # fmt: skip
        if p.replicas:
            print(f"{'':>3} replicas (share: stages) " + "; ".join(f"{r.share}: {list(r.stages)}" for r in p.replicas))
        elif not own and (p.dp_shares or p.pipeline.stages):
            print(f"{'':>3} shares {p.dp_shares or 'even'}; stages {p.pipeline.stages or 'one'}")
        if p.ep > 1:
            held = list(p.expert_shares) if p.expert_shares else "evenly"
            print(f"{'':>3} experts over ep={p.ep} ranks, held {held}")
        if p.groups is not None:  # dp, tp and the shares above are each group's
            g = p.groups
            every = f"every {g.inner_steps} steps" + (f", {g.fragments} fragments in turn" if g.fragments > 1 else "")
            print(
                f"{'':>3} groups: {g.count} (a region each), sync {g.sync}"
                + ("" if g.sync == "every_step" else f" {every}")
            )
    best = found[0]
    for line in ([precision_note] if precision_note else []) + list(best.notes):
        print(f"note: {line}")
    _print_launch(best.plan, cluster, args.out)
    best.plan.save(args.out)
    print(f"wrote {args.out} (plan 0; mem = fullest device's share of its usable memory)")
    print(f"wrote {draw(best, cluster, costs, args.png)}")
    return 0


CONSOLE_LAUNCH_NODES = 4  # more nodes than this: one line per node in a file, a summary on the console


def _print_launch(plan, cluster, out: str) -> None:
    """Which --node-rank each machine gets: plan 0's ranks take each node's devices in turn. Up to a few
    nodes on the console; more in ``<out>.launch.txt``, one torchrun command per node."""
    from tessera.planner.layout import ranks_of

    if len(cluster.nodes) == 1:
        return
    if plan.groups is not None and plan.groups.fault_tolerant:  # a job per group, meeting through a Lighthouse
        from tessera.planner.outer import regions_of

        lines = [
            f"group {g} (region {nodes[0].region}: {', '.join(n.name for n in nodes[:3])}"
            f"{', ...' if len(nodes) > 3 else ''}; {len(nodes)} node(s)): tessera train CONFIG --group {g} "
            f"--lighthouse http://HOST:PORT --nnodes {len(nodes)} --node-rank 0..{len(nodes) - 1}"
            for g, nodes in enumerate(regions_of(cluster))
        ]
        print(
            "launch plan 0 as one job per group: start `tessera lighthouse --bind HOST:PORT` on one machine, then\n  "
            + "\n  ".join(lines)
        )
        return
    devices = cluster.devices()
    order: list[str] = []
    for rank in range(ranks_of(plan, cluster)):
        node = devices[plan.device_of(rank)][0]
        if not order or order[-1] != node:
            order.append(node)
    lines = [
        f"{node}: torchrun --nnodes {len(order)} --node-rank {k} --nproc-per-node {cluster.node(node).count}"
        for k, node in enumerate(order)
    ]
    if len(order) <= CONSOLE_LAUNCH_NODES:
        print("launch plan 0 with torchrun, one command per node:\n  " + "\n  ".join(lines))
        return
    path = Path(out).with_suffix(".launch.txt")
    check_output_file(str(path), "the launch file", force=True)
    path.write_text("\n".join(lines) + "\n")
    print(
        f"launch plan 0 on {len(order)} nodes ({ranks_of(plan, cluster)} ranks) with torchrun: one command per "
        f"node in {path} (first {order[0]} --node-rank 0, last {order[-1]} --node-rank {len(order) - 1})"
    )


def _train(args: argparse.Namespace) -> int:
    from tessera.train.config import plan_from_config
    from tessera.train.launch import Launch, launch
    from tessera.train.preflight import check_training

    if args.emulate:  # read by every rank's Booster (tessera.cluster.emulate)
        from tessera.cluster.spec import Cluster

        Cluster.load(args.emulate)
        os.environ["TESSERA_EMULATE"] = str(Path(args.emulate).resolve())
    if args.testbed and (args.emulate or args.nnodes > 1 or args.rdzv_endpoint):
        raise ValueError(
            "--testbed plays a cluster on this one machine: drop --emulate, --nnodes and --rdzv-endpoint with it."
        )
    cfg = check_training(args.config, args.overrides, args.nproc, args.nnodes, args.overwrite, args.group)
    rank_args = [args.config, *(f"--set={o}" for o in args.overrides), *(["--overwrite"] if args.overwrite else [])]
    if "LOCAL_RANK" in os.environ:  # already a torchrun/SLURM-launched rank
        from tessera.train.run import main as run_main

        return run_main(rank_args)
    groups = plan_from_config(cfg.plan).groups
    if groups is not None and groups.fault_tolerant:  # one job per group, meeting through torchft
        from tessera.train import group_jobs

        if args.testbed or args.emulate:
            raise ValueError(
                "fault-tolerant plan.groups runs a job per group: --testbed and --emulate do not support it yet."
            )
        if args.group is not None:
            return group_jobs.launch_one_group(args, cfg, rank_args)
        if args.nnodes > 1 or args.rdzv_endpoint:
            raise ValueError(
                "fault-tolerant plan.groups on several machines: start `tessera lighthouse`, then launch each group "
                "with --group G --lighthouse ADDRESS."
            )
        return group_jobs.launch_groups_here(args, groups)
    if args.group is not None:
        raise ValueError("--group launches one group of plan.groups with fault_tolerant: true; this config has none.")
    job = Launch(
        rank_args,
        cfg.run_dir,
        nproc=args.nproc,
        nnodes=args.nnodes,
        max_restarts=args.max_restarts,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        local_addr=args.local_addr,
    )
    if args.testbed:
        plan = plan_from_config(cfg.plan).resolve(job.nproc)
        devices = [plan.device_of(r) for r in range(job.nproc)]
        return _launch_on_testbed(job, args.testbed, devices, args.testbed_cpus, plan.precision)
    return launch(job)


def _launch_on_testbed(job, cluster_file: str, devices: list[int], cpus: float | None, precision: str) -> int:
    """Launch ``job`` with rank ``r`` in the CPU cgroup and network namespace of cluster device ``devices[r]``."""
    from tessera.cluster.spec import Cluster
    from tessera.testbed import Testbed
    from tessera.train.launch import launch

    with Testbed(Cluster.load(cluster_file), devices, cpus, precision) as bed:
        print(bed.describe(), file=sys.stderr)
        job.testbed_seats, job.testbed_master_addr = bed.seats_file, bed.master_addr
        code = launch(job)
        if traffic := bed.link_traffic():
            print(f"testbed {bed.name} links:\n{traffic}", file=sys.stderr)
        return code


def _cluster_profile(args: argparse.Namespace) -> int:
    """Launch one rank per cluster device to measure devices and links; rank 0 writes the live profile."""
    from tessera.cluster.spec import Cluster
    from tessera.train.config import load_config, plan_from_config
    from tessera.train.launch import Launch, launch

    cluster = Cluster.load(args.cluster)
    cfg = load_config(args.config, [])
    nproc = args.nproc or cluster.world_size // args.nnodes
    if nproc * args.nnodes != cluster.world_size:
        raise ValueError(
            f"a profile needs one rank per device: the cluster file has {cluster.world_size} devices, the launch "
            f"{nproc * args.nnodes} ranks ({args.nnodes} node(s) x {nproc}); fix --nproc/--nnodes."
        )
    check_output_file(args.out, "--out", args.force)
    out = Path(args.out).resolve()
    job = Launch(
        [str(Path(args.config).resolve()), str(Path(args.cluster).resolve()), str(out)] + ["--quick"] * args.quick,
        out.parent,
        nproc=nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr,
        module="tessera.train.profile_run",
    )
    if args.testbed:
        if args.nnodes > 1:
            raise ValueError("--testbed plays the cluster on this one machine: drop --nnodes with it.")
        precision = plan_from_config(cfg.plan).precision
        return _launch_on_testbed(job, args.cluster, list(range(nproc)), args.testbed_cpus, precision)
    return launch(job)


def _export(args: argparse.Namespace) -> int:
    from tessera.export import check_export_targets, export_hf, export_safetensors

    if not args.out and not args.hf_dir:
        raise ValueError("tessera export needs --out FILE.safetensors and/or --hf-dir DIR.")
    check_export_targets(args.checkpoint, args.out, args.hf_dir, args.force)
    if args.out:
        print(f"wrote {export_safetensors(args.checkpoint, args.out)}")
    if args.hf_dir:
        print(f"wrote {export_hf(args.checkpoint, args.hf_dir)}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    import json

    from tessera.merge import merge

    if args.out:
        check_output_file(args.out, "--out", args.force)
    report, average = merge(args.checkpoints, args.eval_bytes)
    print(report.table())
    if args.json:
        check_output_file(args.json, "--json", args.force)
        Path(args.json).write_text(json.dumps({"held_out_loss": report.losses, "tokens": report.tokens}, indent=1))
    if args.out:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in average.items()}, args.out, metadata={"format": "pt"})
        print(f"wrote the average to {args.out}")
    return 0


def _cluster(args: argparse.Namespace) -> int:
    from tessera.cluster.spec import Cluster

    if args.cluster_command == "profile":
        return _cluster_profile(args)
    if args.cluster_command == "detect":
        from tessera.cluster.detect import describe, detect

        text = describe(detect(args.name))
        if args.out:
            check_output_file(args.out, "--out", args.force)
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


def _data_prepare(args: argparse.Namespace) -> int:
    from tessera.data.prepare import prepare

    started = time.perf_counter()
    index = prepare(args.inputs, args.out, args.tokenizer, args.field, args.workers, args.on_bad_record)
    seconds = time.perf_counter() - started
    skipped = f", {index['skipped']:,} records skipped" if index["skipped"] else ""
    print(
        f"{args.out}: {index['tokens']:,} tokens ({index['dtype']}) in {index['documents']:,} documents, "
        f"{len(index['shards'])} shards{skipped}; {seconds:.1f} s"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="tessera", description="Scale PyTorch training with one Plan.")
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
    train.add_argument(
        "--overwrite", action="store_true", help="a fresh run may delete another run's checkpoints in its run directory"
    )
    train.add_argument("--nproc", type=_count(1), default=2, help="ranks per node")
    train.add_argument("--nnodes", type=_count(1), default=1)
    train.add_argument("--rdzv-endpoint", default="", help="host:port of the rendezvous (multi-node)")
    train.add_argument("--rdzv-id", default="tessera")
    train.add_argument(
        "--local-addr",
        default="",
        help="several machines: this node's address the ranks listen on (one machine: 127.0.0.1)",
    )
    train.add_argument("--max-restarts", type=_count(0), default=0, help="torchrun restarts after a rank fails")
    train.add_argument("--emulate", help="a cluster file whose devices the local ranks play (slowed, memory-checked)")
    train.add_argument(
        "--testbed",
        metavar="CLUSTER",
        help="a cluster file played for real here (root): each rank in a CPU cgroup at its device's speed, "
        "each node a network namespace with shaped links",
    )
    train.add_argument(
        "--testbed-cpus",
        type=float,
        help="cores the whole cluster gets, shared by device speed (default: this machine's less a third of a core)",
    )
    train.add_argument(
        "--group", type=_count(0), help="fault-tolerant plan.groups on several machines: launch only this group"
    )
    train.add_argument("--lighthouse", default="", help="with --group: the Lighthouse's address (http://HOST:PORT)")
    train.add_argument(
        "--lighthouse-bind",
        default="127.0.0.1:0",
        help="fault-tolerant plan.groups on one machine: where the Lighthouse listens (port 0: any free one)",
    )
    lighthouse = sub.add_parser("lighthouse", help="serve the torchft Lighthouse of fault-tolerant plan.groups")
    lighthouse.add_argument("--bind", default="127.0.0.1:29510", help="host:port to listen on (every group dials it)")
    lighthouse.add_argument("--min-groups", type=_count(1), default=1, help="the fewest groups a quorum may have")
    lighthouse.add_argument(
        "--heartbeat-timeout-s", type=float, default=5.0, help="how long a silent group counts as alive"
    )
    lighthouse.add_argument(
        "--join-timeout-s", type=float, default=3600.0, help="how long a sync waits for a live group to reach it"
    )
    testbed = sub.add_parser("testbed", help="the one-machine testbed's housekeeping")
    testbed_sub = testbed.add_subparsers(dest="testbed_command", required=True)
    testbed_sub.add_parser("clean", help="remove cgroups and namespaces left by a testbed whose launcher was killed")
    plan = sub.add_parser("plan", help="plan a model on a cluster, or check a Plan file")
    plan.add_argument("--model", help="a training config (its model:, data.seq_len and plan.precision are read)")
    plan.add_argument("--cluster", help="a cluster file (tessera cluster detect writes one)")
    plan.add_argument("--global-batch", type=_count(1), help="samples per optimizer step")
    plan.add_argument("--top", type=_count(1), default=5, help="how many plans to list")
    plan.add_argument("--profile", help="a live profile (tessera cluster profile): plan from measured speeds and links")
    plan.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        help="compute precision (default: the config's plan.precision); bf16 or auto beside devices without "
        "bf16 plans fp16 with loss scaling",
    )
    plan.add_argument(
        "--pin-precision", action="store_true", help="keep the precision as asked: refuse devices without it"
    )
    plan.add_argument("--out", default="plan.yaml", help="where to write the best Plan")
    plan.add_argument("--png", default="plan.png", help="where to draw devices by stage and the simulated timeline")
    plan_sub = plan.add_subparsers(dest="plan_command")
    check = plan_sub.add_parser("check", help="validate a Plan file")
    check.add_argument("file")
    check.add_argument("--world-size", type=_count(1), required=True)
    cluster = sub.add_parser("cluster", help="describe clusters: detect this machine, check a cluster file")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    detect = cluster_sub.add_parser("detect", help="write a cluster file for this machine")
    detect.add_argument("--out", help="file to write (default: print it)")
    detect.add_argument("--name", help="node name (default: the host name)")
    detect.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    cluster_check = cluster_sub.add_parser("check", help="validate a cluster file and list its devices")
    cluster_check.add_argument("file")
    profile = cluster_sub.add_parser(
        "profile", help="measure every device and link of a cluster on a model (one rank per device)"
    )
    profile.add_argument("config", help="a training config: its model, data.seq_len and plan.precision are used")
    profile.add_argument("--cluster", required=True, help="the cluster file the launch plays (rank r = device r)")
    profile.add_argument("--out", default="cluster-profile.json", help="where rank 0 writes the live profile")
    profile.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    profile.add_argument(
        "--quick", action="store_true", help="short timing windows: a smoke check of the job, too noisy to plan from"
    )
    profile.add_argument("--nproc", type=_count(1), help="ranks per node (default: the cluster's devices / --nnodes)")
    profile.add_argument("--nnodes", type=_count(1), default=1)
    profile.add_argument("--rdzv-endpoint", default="", help="host:port of the rendezvous (multi-node)")
    profile.add_argument("--local-addr", default="", help="several machines: this node's address")
    profile.add_argument("--testbed", action="store_true", help="play the cluster on this machine's testbed (root)")
    profile.add_argument("--testbed-cpus", type=float, help="cores the whole cluster gets, shared by device speed")
    export = sub.add_parser("export", help="write a checkpoint's full model as safetensors / Hugging Face")
    export.add_argument("checkpoint")
    export.add_argument("--out", help="a .safetensors file to write")
    export.add_argument("--hf-dir", help="a directory for save_pretrained (Hugging Face models)")
    export.add_argument("--force", action="store_true", help="overwrite an existing --out file or --hf-dir")
    merge = sub.add_parser("merge", help="judge islands (groups' or runs' models) on held-out text, average them")
    merge.add_argument("checkpoints", nargs="+", help="checkpoint directories (each group folder is an island)")
    merge.add_argument("--eval-bytes", type=_count(1), default=1 << 17, help="held-out bytes to judge on")
    merge.add_argument("--out", help="write the parameter average as a .safetensors file")
    merge.add_argument("--json", help="write the losses as JSON")
    merge.add_argument("--force", action="store_true", help="overwrite --out / --json if they exist")
    data = sub.add_parser("data", help="prepare corpora for training")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser(
        "prepare", help="tokenize text, jsonl, parquet or datasets directories into shards (resumable)"
    )
    prepare.add_argument("inputs", nargs="+", help="files, globs, or datasets save_to_disk directories")
    prepare.add_argument("--out", required=True, help="the folder to write (started again: resumed)")
    prepare.add_argument("--tokenizer", default="bytes", help="a tokenizer.json or its directory; bytes by default")
    prepare.add_argument("--field", default="text", help="the jsonl field or parquet/arrow column holding the text")
    prepare.add_argument(
        "--workers",
        type=_count(1),
        help="tokenizing processes (default: 1 for a tokenizer.json, whose library uses every core; the CPUs "
        "for bytes)",
    )
    prepare.add_argument(
        "--on-bad-record", choices=("stop", "skip"), default="stop", help="a record that is not JSON or lacks the "
        "field: stop (default) or skip, counted"
    )  # fmt: skip
    args = ap.parse_args(argv)
    try:
        if args.command == "data":
            return _data_prepare(args)
        if args.command == "export":
            return _export(args)
        if args.command == "merge":
            return _merge(args)
        if args.command == "cluster":
            return _cluster(args)
        if args.command == "lighthouse":
            from tessera.train.group_jobs import serve_lighthouse

            return serve_lighthouse(args.bind, args.min_groups, args.heartbeat_timeout_s, args.join_timeout_s)
        if args.command == "testbed":
            from tessera.testbed import clean_stale

            removed = clean_stale()
            print(f"removed {len(removed)} stale testbed(s){': ' + ', '.join(removed) if removed else ''}")
            return 0
        if args.command == "train":
            if args.resume:
                args.overrides.append("checkpoint.resume=auto")
            return _train(args)
        return _plan_check(args) if args.plan_command == "check" else _plan(args)
    except KeyboardInterrupt:
        print("tessera: error: interrupted.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, FileNotFoundError) as exc:  # PlanError, ConfigError, CheckpointError, InputError
        print(f"tessera: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # the machine refused a read or write the checks could not foresee
        print(f"tessera: error: {exc.strerror or exc}: '{exc.filename}'.", file=sys.stderr)
        return EXIT_RUNTIME_FAULT
    except Exception as exc:  # a bug: one paragraph, and the traceback for the report
        print(
            f"tessera: error: internal error {type(exc).__name__}: {exc} (TESSERA_DEBUG=1 shows the traceback).",
            file=sys.stderr,
        )
        if os.environ.get("TESSERA_DEBUG"):
            traceback.print_exc()
        return EXIT_RUNTIME_FAULT


if __name__ == "__main__":
    sys.exit(main())
