"""Entry point of one training rank: ``python -m tessera.train.run CONFIG [--set k=v ...]``.

``tessera train`` launches this under torchrun; it can also be launched by torchrun or SLURM
directly. However the rank ends, it says so through :mod:`tessera.launch.failures`: one
``tessera: error: rank R, step S: ...`` line on stderr, a report for the launcher, and an exit
code (2 bad input, 3 collective timeout, 4 runtime fault), never a bare traceback.
"""

from __future__ import annotations

import argparse
import sys

from tessera import log
from tessera.errors import EXIT_OK
from tessera.launch.failures import Reporter
from tessera.launch.node_rank import take_planned_rank


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tessera.train.run")
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--overwrite", action="store_true", help="a fresh run may replace another run's files")
    args = ap.parse_args(argv)
    placed = take_planned_rank()  # --node-rank: RANK is the plan's, before anything reads it
    log.setup(prefix=log.group_prefix())  # the launcher's level (TESSERA_LOG_LEVEL); [group G] under several groups
    if placed is not None:
        log.get("launch").info(placed)
    reporter = Reporter()
    reporter.started()
    trainer = None
    try:
        from tessera.config import load_config
        from tessera.train.trainer import Trainer

        trainer = Trainer(load_config(args.config, args.overrides), overwrite=args.overwrite)
        trainer.run()
        from tessera.distributed import shutdown

        shutdown()
    except BaseException as exc:  # noqa: BLE001 - every way a rank ends is reported
        return reporter.failed(exc, trainer.where() if trainer is not None else "set-up")
    reporter.finished()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
