"""Text data: a byte-level tokenizer and a packed-sequence dataset over text files.

The default corpus is the Python standard library's own source files of the
running interpreter: present on every machine, real text nobody here wrote.
"""

from __future__ import annotations

import glob
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset


class ByteTokenizer:
    """Tokens are bytes (vocabulary 256): nothing to train, nothing to download."""

    vocab_size = 256
    end_of_document = [10]  # files are joined with a newline

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(int(t) % 256 for t in tokens).decode("utf-8", errors="replace")


def default_corpus() -> list[str]:
    """The running interpreter's standard-library ``*.py`` files, sorted."""
    return sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))


def matching(pattern: str, accept: Callable[[Path], bool] = Path.is_file) -> list[str]:
    """What a path or a glob (sorted matches, ``**`` across folders) names, keeping what ``accept`` takes."""
    matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
    return [m for m in matched if accept(Path(m))]


def resolve_paths(patterns: list[str]) -> list[str]:
    """Expand paths and globs; every pattern must match at least one file."""
    if not patterns:
        return default_corpus()
    files: list[str] = []
    for pattern in patterns:
        matched = matching(pattern)
        if not matched:
            raise FileNotFoundError(f"data.paths: '{pattern}' matches no file: give existing text files or a glob.")
        files.extend(matched)
    return files


def _require_enough(n_tokens: int, seq_len: int, unit: str = "bytes") -> None:
    if n_tokens < 2 * (seq_len + 1):
        raise ValueError(
            f"data: the corpus holds {n_tokens} {unit}, too few for even two sequences of data.seq_len="
            f"{seq_len}: add text or lower data.seq_len."
        )


def check_corpus_size(files: list[str], seq_len: int, max_bytes: int) -> None:
    """PackedText's size check from file sizes alone, so a launcher can refuse a tiny corpus
    without reading it (each file counts one separator byte, as PackedText adds)."""
    _require_enough(min(max_bytes, sum(Path(f).stat().st_size + 1 for f in files)), seq_len)


class PackedText(Dataset):
    """Windows of ``seq_len + 1`` tokens over all files joined end to end.

    Item ``i`` is ``{"x": tokens[i*L : i*L+L], "y": tokens[i*L+1 : i*L+L+1]}``.
    """

    def __init__(
        self, files: list[str], seq_len: int, max_bytes: int = 4_000_000, skip_bytes: int = 0, tokenizer: Any = None
    ) -> None:
        """``skip_bytes``: start that far into the joined files (held-out text: what follows the
        ``max_bytes`` a training run read). ``tokenizer``: bytes by default; another one
        (:mod:`tessera.data.tokenizer`) encodes each file's part of that text, ending each with its
        end-of-document token."""
        parts, seen = [], 0
        for path in files:
            data = Path(path).read_bytes() + b"\n"
            lo, hi = max(seen, skip_bytes), min(seen + len(data), skip_bytes + max_bytes)
            if lo < hi:
                parts.append(data[lo - seen : hi - seen])
            seen += len(data)
            if seen >= skip_bytes + max_bytes:
                break
        self.tokens = _encode(parts, seq_len, tokenizer)
        self.seq_len = seq_len
        self.files = files

    @classmethod
    def of_texts(cls, texts: Iterable[str], seq_len: int, max_bytes: int, tokenizer: Any, source: str) -> PackedText:
        """Documents (rows of a dataset's text column) joined as files are, up to ``max_bytes`` of text."""
        parts, seen = [], 0
        for text in texts:
            data = text.encode("utf-8") + b"\n"
            parts.append(data[: max_bytes - seen])
            seen += len(parts[-1])
            if seen >= max_bytes:
                break
        packed = cls.__new__(cls)
        packed.tokens, packed.seq_len, packed.files = _encode(parts, seq_len, tokenizer), seq_len, [source]
        return packed

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return {"x": window[:-1], "y": window[1:]}


def _encode(parts: list[bytes], seq_len: int, tokenizer: Any) -> torch.Tensor:
    """Documents' bytes (each ending in a newline) as one token stream: the bytes themselves, or each
    document encoded by ``tokenizer`` and ended with its end-of-document token."""
    if tokenizer is None or isinstance(tokenizer, ByteTokenizer):
        joined = bytearray(b"".join(parts))
        _require_enough(len(joined), seq_len)
        return torch.frombuffer(joined, dtype=torch.uint8).long()
    # a document per part (its trailing newline is the byte tokenizer's separator)
    texts = [p.decode("utf-8", errors="replace").removesuffix("\n") for p in parts]
    end = tokenizer.end_of_document
    tokens = torch.tensor([t for ids in tokenizer.encode_batch(texts) for t in [*ids, *end]])
    _require_enough(len(tokens), seq_len, "tokens")
    return tokens
