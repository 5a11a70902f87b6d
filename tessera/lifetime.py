"""Processes that do not outlive the launcher that started them.

``tessera train`` runs torchrun in a session of its own (so a Ctrl-C at the terminal reaches the
launcher first, which then stops the ranks in order). That also hides the ranks from any signal
sent to the launcher alone: a ``kill`` of the launcher, a scheduler's SIGTERM or a test's timeout
left torchrun and every rank running. Two guards close that:

- :func:`termination_unwinds`: SIGTERM and SIGHUP raise ``SystemExit`` like Ctrl-C raises
  ``KeyboardInterrupt``, so the launcher's ``finally`` blocks stop what it started;
- :func:`dies_with_parent`: a ``preexec_fn`` that asks Linux to SIGTERM the child when its parent
  dies, which also covers SIGKILL (nothing can be caught then).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def termination_unwinds() -> Iterator[None]:
    """Within the block, the first SIGTERM or SIGHUP raises ``SystemExit(128 + signal)``; later ones are
    ignored, so that the clean-up the first one started is not cut short. (A child of a multi-threaded
    process can get its parent-death signal once per thread of the parent as they exit.) The handlers
    before it come back after. Only the main thread can set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def unwind(signum: int, frame: FrameType | None) -> None:
        if not caught:
            caught.append(signum)
            raise SystemExit(128 + signum)

    before: dict[int, Any] = {sig: signal.signal(sig, unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def signal_name(exit_code: object) -> str:
    """The signal behind a ``SystemExit`` raised by :func:`termination_unwinds` ("SIGTERM"), else "a signal"."""
    try:
        return signal.Signals(int(exit_code) - 128).name  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return "a signal"


def dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGTERM when this process dies, however
    it dies. None where the kernel has no such request (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def request() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died between fork and the request
            os.kill(os.getpid(), signal.SIGTERM)

    return request
