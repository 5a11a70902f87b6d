"""Tessera's console messages, through the standard ``logging`` module.

Every message of a run goes to the ``tessera`` logger (``tessera.<part>`` below it) and from there to
stdout as a plain line; warnings and errors keep their level in front. ``tessera --log-level LEVEL``
(or ``-q``: warnings only) sets the level for the launcher and, through ``TESSERA_LOG_LEVEL``, for every
rank. A rank of one of several groups prefixes its lines with ``[group G]``, so the groups' lines can be
told apart where they interleave.

Libraries beneath are held at WARNING unless the level is DEBUG: torchft's INFO logs (its Rust client and
server too, through ``RUST_LOG``), transformers' INFO logs and its FutureWarnings.

Example::

    from tessera import log

    log.setup("info")
    log.get("train").info("resumed from %s at step %d", path, step)
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

LEVEL_ENV = "TESSERA_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
NOISY = ("torchft", "transformers", "torch.distributed.elastic", "httpx", "urllib3", "filelock")


class _Plain(logging.Formatter):
    """The message alone at INFO and below; ``warning: ...`` / ``error: ...`` above; the prefix in front."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return "\n".join(self.prefix + line for line in text.splitlines()) if self.prefix else text


class _Stdout(logging.StreamHandler):
    """A handler writing to whatever ``sys.stdout`` is when a line is written (not when it was made)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stdout

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def level_name(level: str | None = None) -> str:
    """The level asked for (``level``, else ``TESSERA_LOG_LEVEL``, else info), checked."""
    name = (level or os.environ.get(LEVEL_ENV) or "info").lower()
    if name not in LEVELS:
        raise ValueError(f"log level {name!r} is not one of {', '.join(LEVELS)} (--log-level or {LEVEL_ENV}).")
    return name


def setup(level: str | None = None, prefix: str = "") -> None:
    """Send the ``tessera`` logger's messages to stdout at ``level`` (see :func:`level_name`), prefixed;
    hold the libraries beneath at WARNING unless the level is debug. Sets ``TESSERA_LOG_LEVEL`` for the
    processes this one starts. Called again, it replaces what it set before."""
    name = level_name(level)
    os.environ[LEVEL_ENV] = name
    logger = logging.getLogger("tessera")
    logger.setLevel(name.upper())
    logger.propagate = False
    for handler in list(logger.handlers):
        if getattr(handler, "_tessera", False):
            logger.removeHandler(handler)
    handler = _Stdout()
    handler.setFormatter(_Plain(prefix))
    handler._tessera = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    quiet = name != "debug"
    for library in NOISY:
        logging.getLogger(library).setLevel(logging.WARNING if quiet else logging.DEBUG)
    if quiet:
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust manager and Lighthouse
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchft(\.|$)")


def ensure() -> None:
    """:func:`setup` with the environment's level and this process's group prefix, unless already set up
    (a program that uses the Trainer directly still sees its messages)."""
    if not any(getattr(h, "_tessera", False) for h in logging.getLogger("tessera").handlers):
        setup(prefix=group_prefix())


def get(part: str) -> logging.Logger:
    """The logger of one part of Tessera (``tessera.<part>``)."""
    return logging.getLogger(f"tessera.{part}")


def group_prefix() -> str:
    """``[group G] `` for a rank of one of several groups' jobs (``TESSERA_GROUP`` set), else nothing."""
    group = os.environ.get("TESSERA_GROUP")
    return f"[group {group}] " if group not in (None, "") else ""
