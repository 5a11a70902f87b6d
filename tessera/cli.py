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

from tessera.arguments import build_parser
from tessera.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_RUNTIME_FAULT
from tessera.inputs import check_output_file


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
    args = build_parser().parse_args(argv)
    from tessera import log

    log.setup("warning" if args.quiet else args.log_level)
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
