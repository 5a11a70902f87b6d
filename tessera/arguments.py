"""The ``tessera`` command line's arguments: every subcommand, each argument with its help and default.

Kept apart from :mod:`tessera.cli` (which runs the commands) and free of heavy imports, so that
``tessera --help`` and ``tessera --version`` answer at once (docs/benchmarks.md has the time).
"""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import Any, NoReturn

from tessera.errors import EXIT_BAD_INPUT


class _WithDefaults(argparse.HelpFormatter):
    """Help that names each argument's default, where it has one worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unsaid = default is None or default is False or default in ("", [], argparse.SUPPRESS)  # 0 is said
        if "default" in text or unsaid or action.required:
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one ``tessera: error:`` paragraph (exit 2) like every other error, and
    every argument's help ends with its default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _WithDefaults)
        super().__init__(*args, **kwargs)

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


def _version() -> str:
    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    from tessera import __version__

    return f"tessera {__version__} (torch {installed('torch')}, transformers {installed('transformers')})"


def _console_options(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """``--log-level`` and ``-q``, before the command (``tessera -q train ...``) or after it (``tessera train
    ... -q``): after it they default to nothing, so the command's parser does not undo what came before."""
    unset = {"default": argparse.SUPPRESS} if after_command else {}
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="what the console shows (default: info, or TESSERA_LOG_LEVEL); debug also lets the libraries "
        "beneath (torchft, transformers) speak",
        **unset,
    )
    quiet_default = unset or {"default": False}
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="warnings and errors only (--log-level warning)", **quiet_default
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``tessera`` subcommand."""
    ap = _Parser(prog="tessera", description="Scale PyTorch training with one Plan.")
    ap.add_argument("--version", action="version", version=_version())
    _console_options(ap)
    sub = ap.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train from a YAML config (launches torchrun)")
    train.add_argument("config", help="the training config (YAML): model, data, optimizer, plan, train ...")
    _console_options(train, after_command=True)
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
    train.add_argument("--nproc", type=_count(1), default=2, help="ranks per machine (one per GPU, or CPU processes)")
    train.add_argument("--nnodes", type=_count(1), default=1, help="machines in the job (torchrun's --nnodes)")
    train.add_argument("--rdzv-endpoint", default="", help="host:port of the rendezvous (multi-node)")
    train.add_argument(
        "--node-rank",
        type=_count(0),
        help="this machine's place in plan.file's launch, as `tessera plan` prints it: its ranks take that "
        "machine's plan ranks, whatever order the rendezvous gives the machines",
    )
    train.add_argument("--rdzv-id", default="tessera", help="the job's rendezvous id, the same on every machine")
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
        choices=("auto", "fp32", "bf16", "fp16", "fp8"),
        help="compute precision (default: the config's plan.precision); bf16 or auto beside devices without "
        "bf16 plans fp16 with loss scaling; fp8 only on devices with an fp8 figure",
    )
    plan.add_argument(
        "--pin-precision", action="store_true", help="keep the precision as asked: refuse devices without it"
    )
    plan.add_argument("--out", default="plan.yaml", help="where to write the best Plan")
    plan.add_argument("--png", default="plan.png", help="where to draw devices by stage and the simulated timeline")
    plan_sub = plan.add_subparsers(dest="plan_command")
    check = plan_sub.add_parser("check", help="validate a Plan file")
    check.add_argument("file", help="a Plan file (tessera plan writes one)")
    check.add_argument("--world-size", type=_count(1), help="the ranks the plan is to run on (default: the file's)")
    cluster = sub.add_parser("cluster", help="describe clusters: detect this machine, check a cluster file")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    detect = cluster_sub.add_parser("detect", help="write a cluster file for this machine")
    detect.add_argument("--out", help="file to write (default: print it)")
    detect.add_argument("--name", help="node name (default: the host name)")
    detect.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    cluster_check = cluster_sub.add_parser("check", help="validate a cluster file; print its nodes, devices and links")
    cluster_check.add_argument("file", help="a cluster file (YAML: nodes, device types, links)")
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
    profile.add_argument("--nnodes", type=_count(1), default=1, help="machines in the job (torchrun's --nnodes)")
    profile.add_argument("--rdzv-endpoint", default="", help="host:port of the rendezvous (multi-node)")
    profile.add_argument("--local-addr", default="", help="several machines: this node's address")
    profile.add_argument("--testbed", action="store_true", help="play the cluster on this machine's testbed (root)")
    profile.add_argument("--testbed-cpus", type=float, help="cores the whole cluster gets, shared by device speed")
    export = sub.add_parser("export", help="write a checkpoint's full model as safetensors / Hugging Face")
    export.add_argument("checkpoint", help="a checkpoint directory (runs/NAME/checkpoints/step_N)")
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
    prepare.add_argument("--tokenizer", default="bytes", help="a tokenizer directory or tokenizer.json, or bytes")
    prepare.add_argument("--field", default="text", help="the jsonl field or parquet/arrow column holding the text")
    prepare.add_argument(
        "--workers",
        type=_count(1),
        help="tokenizing processes (default: 1 for a tokenizer.json, whose library uses every core; the CPUs "
        "for bytes)",
    )
    prepare.add_argument(
        "--on-bad-record", choices=("stop", "skip"), default="stop", help="a record that is not JSON or lacks the "
        "field: stop, or skip it (counted)"
    )  # fmt: skip
    return ap
