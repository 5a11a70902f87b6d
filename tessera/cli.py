"""The ``tessera`` command.

    tessera train CONFIG.yaml [--set optimizer.lr=3e-4 ...] [--nproc N]   config-driven training (via torchrun)
    tessera plan --model CONFIG.yaml --cluster C.yaml --global-batch B    best plans, a Plan file and a picture
    tessera plan check PLAN.yaml --world-size N                           validate a Plan file for N ranks
    tessera cluster profile CONFIG.yaml --cluster C.yaml [--testbed]      measure devices and links for the planner
    tessera testbed clean                                                 remove what a killed testbed left
    tessera export CHECKPOINT --out model.safetensors [--hf-dir DIR] [--adapter-dir DIR]  full model, PEFT adapter
    tessera merge CHECKPOINT... [--out merged.safetensors]                islands' held-out losses, averaged, ensembled

Every failure prints one ``tessera: error: ...`` paragraph. Exit codes: 2 bad input, 3 a collective
timed out (a rank died or hung), 4 a runtime fault (out of memory, disk full, a crashed rank),
130 interrupted (see :mod:`tessera.launch.failures`).
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
from tessera.launch.failures import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RUNTIME_FAULT


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


def _export(args: argparse.Namespace) -> int:
    from tessera.export import check_export_targets, export_adapter, export_hf, export_safetensors

    if not args.out and not args.hf_dir and not args.adapter_dir:
        raise ValueError("tessera export needs --out FILE.safetensors, --hf-dir DIR and/or --adapter-dir DIR.")
    check_export_targets(args.checkpoint, args.out, args.hf_dir, args.force, args.adapter_dir)
    if args.out:
        print(f"wrote {export_safetensors(args.checkpoint, args.out)}")
    if args.hf_dir:
        print(f"wrote {export_hf(args.checkpoint, args.hf_dir)}")
    if args.adapter_dir:
        print(f"wrote {export_adapter(args.checkpoint, args.adapter_dir)} (PeftModel.from_pretrained(base, it))")
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
        from tessera.launch.commands import cluster_profile

        return cluster_profile(args)
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
    print(cluster.describe())
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
        "--overwrite",
        action="store_true",
        help="start fresh: delete another run's checkpoints and metrics in the run directory (whatever "
        "checkpoint.resume says)",
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
    export.add_argument("--adapter-dir", help="a LoRA run's adapters as a PEFT adapter folder")
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
            from tessera.launch.group_jobs import serve_lighthouse

            return serve_lighthouse(args.bind, args.min_groups, args.heartbeat_timeout_s, args.join_timeout_s)
        if args.command == "testbed":
            from tessera.testbed import clean_stale

            removed = clean_stale()
            print(f"removed {len(removed)} stale testbed(s){': ' + ', '.join(removed) if removed else ''}")
            return 0
        if args.command == "train":
            if args.resume and args.overwrite:
                raise ValueError("--resume continues a run and --overwrite starts a fresh one: pass one of them.")
            if args.resume:
                args.overrides.append("checkpoint.resume=auto")
            from tessera.launch.commands import train

            return train(args)
        from tessera.planner import command as planning

        return planning.check_plan_file(args) if args.plan_command == "check" else planning.plan(args)
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
