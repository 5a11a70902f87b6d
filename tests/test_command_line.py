"""The command line (issue 33, item 7): every argument of every subcommand has help, the help names its
default, ``--version`` names the versions, and ``--help`` imports neither torch nor transformers (its time
is a line in docs/benchmarks.md, not asserted here)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from tessera.arguments import build_parser


def _parsers(parser: argparse.ArgumentParser, name: str = "tessera"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_argument_has_help_and_its_help_names_its_default() -> None:
    missing, unsaid = [], []
    for name, parser in _parsers(build_parser()):
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)):
                continue
            label = f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
            if not action.help:
                missing.append(label)
            elif (
                action.default is not None
                and action.default is not False
                and action.default not in ("", [], argparse.SUPPRESS)
            ):
                if f"default: {action.default}" not in " ".join(text.split()):
                    unsaid.append(label)
    assert not missing, f"arguments without help: {missing}"
    assert not unsaid, f"defaults the help does not name: {unsaid}"
    assert "(default: 2)" in " ".join(
        build_parser()._subparsers._group_actions[0].choices["train"].format_help().split()
    )


def test_version_and_help_answer_without_importing_torch() -> None:
    heavy = "('torch', 'transformers', 'pydantic')"
    code = ("import sys\nfrom tessera.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            f"print('heavy:', sorted(m for m in {heavy} if m in sys.modules))")  # fmt: skip
    for flag in ("--version", "--help"):
        out = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, timeout=60).stdout
        assert out.rstrip().endswith("heavy: []"), out
    version = subprocess.run([sys.executable, "-m", "tessera.cli", "--version"], capture_output=True, text=True).stdout
    assert version.startswith("tessera 0.1.0 (torch 2.") and "transformers" in version


def test_a_usage_mistake_is_one_error_paragraph(capsys: pytest.CaptureFixture[str]) -> None:
    from tessera.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["train", "c.yaml", "--nproc", "0"])
    assert ended.value.code == 2
    assert "tessera: error: tessera train: argument --nproc: 0 must be at least 1" in capsys.readouterr().err


def test_the_slurm_example_asks_for_what_it_uses_and_its_tessera_command_parses() -> None:
    """examples/slurm.sbatch: its #SBATCH lines are option=value pairs sbatch knows, one launcher task per
    node, and the `tessera train` line each node runs parses with the real parser, every node the same job."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).parent.parent / "examples" / "slurm.sbatch").read_text()
    options = dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S+)", text, flags=re.M))
    assert len(options) == len(re.findall(r"^#SBATCH", text, flags=re.M)), "an #SBATCH line that is not --key=value"
    known = {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output"}
    assert options.keys() <= known, options.keys() - known
    assert options["ntasks-per-node"] == "1"  # tessera train starts the node's ranks itself (torchrun)
    command = re.search(r"bash -c '(tessera train .*?)'", text, flags=re.S).group(1).replace("\\\n", " ")
    values = {"$0": "c.yaml", "$1": "node1", "$2": "29500", "$SLURM_NNODES": "2", "$SLURM_GPUS_ON_NODE": "8",
              "$SLURM_JOB_ID": "77", "$(hostname)": "node2"}  # fmt: skip
    for name, value in values.items():
        command = command.replace(f'"{name}"', value).replace(name, value)
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert (args.command, args.config, args.nnodes, args.nproc) == ("train", "c.yaml", 2, 8)
    assert (args.rdzv_endpoint, args.rdzv_id, args.local_addr, args.max_restarts) == ("node1:29500", "77", "node2", 1)


def test_the_dockerfile_copies_what_exists_and_installs_extras_the_package_has() -> None:
    """examples/Dockerfile cannot be built here (no Docker daemon, no registry): what it names is checked
    instead. Every COPY source exists, every extra it installs is in pyproject.toml, its torch is the
    Makefile's pin, and the command its header shows parses."""
    import re
    import shlex
    from pathlib import Path

    repo = Path(__file__).parent.parent
    text = (repo / "examples" / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.+)$", text, flags=re.M):
        sources = line.split()[:-1]
        assert sources and all((repo / s).exists() for s in sources), line
    section = (repo / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = dict.fromkeys(re.findall(r"^([a-z]+) = \[", section, flags=re.M))  # (tomllib: Python 3.11 on)
    default_extras = re.search(r"^ARG EXTRAS=(\S+)$", text, flags=re.M).group(1).split(",")
    shown_extras = re.search(r"--build-arg EXTRAS=(\S+)", text).group(1).split(",")
    assert set(default_extras) | set(shown_extras) <= extras.keys(), set(default_extras) - extras.keys()
    assert 'pip install --no-cache-dir -e ".[${EXTRAS}]"' in text
    pin = re.search(r"torch==(\S+)", (repo / "Makefile").read_text()).group(1)
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", text, flags=re.M).group(1) == pin
    run = re.search(r"^# Run: +docker run .* tessera (train .*)$", text, flags=re.M).group(1)
    args = build_parser().parse_args(shlex.split(run))
    assert (args.command, args.config, args.nproc) == ("train", "examples/demo.yaml", 2)


def test_the_console_options_go_before_or_after_the_command() -> None:
    parse = build_parser().parse_args
    assert [(a.quiet, a.log_level) for a in (parse(["-q", "train", "c.yaml"]), parse(["train", "c.yaml", "-q"]))] == [
        (True, None),
        (True, None),
    ]
    assert parse(["--log-level", "debug", "train", "c.yaml"]).log_level == "debug"
    assert parse(["train", "c.yaml", "--log-level", "error"]).log_level == "error"
    assert (parse(["train", "c.yaml"]).quiet, parse(["train", "c.yaml"]).log_level) == (False, None)
