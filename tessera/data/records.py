"""Records of user data (jsonl lines, table rows) and what a bad one does: one rule for every reader.

``data.on_bad_record: stop`` (the default) stops at the first bad record, named by ``file:line`` (or row);
``skip`` leaves it out and counts it, and the count is reported.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from tessera.inputs import InputError

ON_BAD_RECORD = ("stop", "skip")


class BadRecords:
    """Where a bad record stops the job (``on_bad="stop"``) or is left out and counted in ``skipped``."""

    def __init__(self, on_bad: str) -> None:
        if on_bad not in ON_BAD_RECORD:
            raise InputError(f"data.on_bad_record must be one of {', '.join(ON_BAD_RECORD)}, got {on_bad!r}.")
        self.on_bad, self.skipped = on_bad, 0

    def __call__(self, where: str, why: str) -> None:
        """A bad record at ``where`` (``file:line``), ``why`` it is bad."""
        if self.on_bad == "stop":
            raise InputError(f"{where}: {why} (data.on_bad_record: skip leaves such records out, counted).")
        self.skipped += 1


def json_objects(
    lines: Iterable[bytes | str], path: str, bad: BadRecords, first_line: int = 1
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each non-blank line's JSON object with its ``file:line``; a line that is not one goes to ``bad``."""
    for n, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            bad(f"{path}:{n}", f"not a JSON object ({exc})")
            continue
        if not isinstance(record, dict):
            bad(f"{path}:{n}", f"not a JSON object (a {type(record).__name__})")
            continue
        yield f"{path}:{n}", record
