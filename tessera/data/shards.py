"""Training from prepared token shards (:mod:`tessera.data.prepare`) without holding them in memory.

:class:`TokenShards` is a map-style dataset of windows of ``seq_len + 1`` tokens over the shards joined
in order (as :class:`~tessera.data.text.PackedText` is over text): item ``i`` reads its window from disk
(``os.pread``; at most two shards), so memory holds a batch, not the corpus. The shuffle and the position
in it are the sharded loader's (:mod:`tessera.data.sharding`): deterministic from the seed, and in every
checkpoint.
"""

from __future__ import annotations

import bisect
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tessera.data.prepare import FORMAT, INDEX
from tessera.inputs import InputError


def read_index(folder: str | Path) -> dict[str, Any]:
    """A prepared folder's index, checked against its shards' sizes."""
    folder = Path(folder)
    path = folder / INDEX
    if not path.is_file():
        hint = " (interrupted: run `tessera data prepare` again with the same arguments)" if (
            folder / "plan.json"
        ).is_file() else ""  # fmt: skip
        raise InputError(f"data.prepared '{folder}' has no {INDEX}{hint}: prepare it with `tessera data prepare`.")
    try:
        index = json.loads(path.read_text())
        shards, dtype = index["shards"], np.dtype(index["dtype"])
        if index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format')!r}, this Tessera reads {FORMAT}")
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"'{path}' is not a prepared data index ({exc}).") from None
    for shard in shards:
        file = folder / shard["file"]
        if not file.is_file() or file.stat().st_size != shard["tokens"] * dtype.itemsize:
            raise InputError(
                f"'{file}' is missing or not the {shard['tokens']} tokens '{path}' lists: prepare the folder again."
            )
    return index


class TokenShards(Dataset):
    """Windows of ``seq_len + 1`` tokens over the shards of a prepared ``folder``, read as needed; item ``i``
    is ``{"x": tokens[i*L : i*L+L], "y": tokens[i*L+1 : i*L+L+1]}``. ``first``/``count``: the windows used
    (a validation split takes the last ones)."""

    def __init__(self, folder: str | Path, seq_len: int, first: int = 0, count: int | None = None) -> None:
        self.folder, self.seq_len = Path(folder), seq_len
        self.index = read_index(folder)
        self.dtype = np.dtype(self.index["dtype"])
        self.files = [str(self.folder / s["file"]) for s in self.index["shards"]]
        sizes = [s["tokens"] for s in self.index["shards"]]
        self.starts = [0, *np.cumsum(sizes).tolist()]  # each shard's first token in the joined stream
        windows = (self.starts[-1] - 1) // seq_len
        if windows < 2:
            raise InputError(
                f"data.prepared '{folder}' holds {self.starts[-1]} tokens, too few for two sequences of "
                f"data.seq_len={seq_len}: prepare more text or lower data.seq_len."
            )
        self.first = first
        self.count = windows - first if count is None else count
        self._fds: dict[int, int] = {}  # opened per process (a loader's worker opens its own)
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.count

    def _read(self, start: int, n: int) -> np.ndarray:
        if os.getpid() != self._pid:
            self._fds, self._pid = {}, os.getpid()
        parts, item = [], self.dtype.itemsize
        while n > 0:
            shard = bisect.bisect_right(self.starts, start) - 1
            take = min(n, self.starts[shard + 1] - start)
            fd = self._fds.get(shard)
            if fd is None:
                fd = self._fds[shard] = os.open(self.files[shard], os.O_RDONLY)
            raw = os.pread(fd, take * item, (start - self.starts[shard]) * item)
            parts.append(np.frombuffer(raw, dtype=self.dtype))
            start, n = start + take, n - take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        window = torch.from_numpy(self._read((self.first + i) * self.seq_len, self.seq_len + 1).astype(np.int64))
        return {"x": window[:-1], "y": window[1:]}

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass
