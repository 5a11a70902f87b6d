"""Errors Tessera raises for bad input, so users can catch them by type."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# How a Tessera process ends (every rank and ``tessera train``; :mod:`tessera.launch.failures` says when).
EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_COLLECTIVE_TIMEOUT = 3
EXIT_RUNTIME_FAULT = 4
EXIT_INTERRUPTED = 130


class PlanError(ValueError):
    """A Plan (or an argument that depends on it) is invalid.

    The message names the field, what was expected and how to fix it.
    """


class NotSupportedYet(PlanError):
    """A Plan field asks for a feature that has not landed yet."""


class ClusterError(ValueError):
    """A cluster description is malformed: the message names the node or link and the field."""


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, unsafe, or belongs to another model."""


class RuntimeFault(RuntimeError):
    """A fault of the machine rather than the input (disk full while saving, ...); the message says what to do."""


class TestbedError(ValueError):
    """The one-machine testbed cannot be set up here (not root, no cgroup cpu controller, no iproute2,
    a cluster it cannot play); the message says why and what to use instead."""

    __test__ = False  # not a pytest test class, whatever its name


def nearest(name: str, valid: Iterable[str]) -> str:
    """Return ' (did you mean "x"?)' for the closest valid name, or ''."""
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f' (did you mean "{match[0]}"?)' if match else ""
