"""The ``tessera`` command.

tessera demo [--nproc 2] [demo options]     2-rank ZeRO training of a small Llama (via torchrun)
tessera plan check PLAN.yaml --world-size N  validate a Plan file for a job of N ranks
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from tessera.errors import PlanError


def _demo(args: argparse.Namespace, rest: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "tessera.demo",
        *rest,
    ]
    return subprocess.call(cmd)


def _plan_check(args: argparse.Namespace) -> int:
    from tessera.plan import Plan

    plan = Plan.load(args.file).resolve(args.world_size)
    plan.check_supported()
    print(plan.to_yaml(), end="")
    print(f"# valid for {args.world_size} ranks")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tessera", description="Scale PyTorch training with one Plan.")
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small Llama on 2 local ranks under ZeRO")
    demo.add_argument("--nproc", type=int, default=2)
    plan = sub.add_parser("plan", help="work with Plan files")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    check = plan_sub.add_parser("check", help="validate a Plan file")
    check.add_argument("file")
    check.add_argument("--world-size", type=int, required=True)
    args, rest = ap.parse_known_args(argv)
    try:
        if args.command == "demo":
            return _demo(args, rest)
        if rest:
            ap.error(f"unrecognised arguments: {' '.join(rest)}")
        return _plan_check(args)
    except PlanError as exc:
        print(f"tessera: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
