"""Entry point of one training rank: ``python -m tessera.train.run CONFIG [--set k=v ...]``.

``tessera train`` launches this under torchrun; it can also be launched by
torchrun or SLURM directly. Bad input ends the rank with one line
``tessera: error: ...`` on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tessera.train.run")
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    from tessera.train.config import load_config
    from tessera.train.trainer import CollectiveTimeout, train

    try:
        train(load_config(args.config, args.overrides))
    except USER_ERRORS as exc:  # ConfigError, PlanError, CheckpointError are ValueErrors
        print(f"tessera: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except CollectiveTimeout as exc:
        print(f"tessera: error: {exc}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
