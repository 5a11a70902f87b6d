"""``tessera data prepare``: text, jsonl, parquet and ``datasets`` directories → token shards on disk.

The inputs are cut into pieces (a text file; a byte range of a jsonl file, at line ends; a parquet row
group; an arrow file of a ``datasets`` directory), each tokenized by a worker process into its own shard
(``shards/NNNNNN.bin``: the tokens, uint16 or uint32, each document followed by the tokenizer's end
token; ``shards/NNNNNN.json``: its counts). A shard appears only once complete (written beside, then
renamed), so an interrupted run started again with the same arguments tokenizes only the pieces left.
``index.json``, written last, lists the shards in input order; training reads them with
:class:`tessera.data.shards.TokenShards`, never holding the corpus in memory.

Example::

    tessera data prepare corpus/*.jsonl --field text --tokenizer tok/ --out data/prepared --workers 4
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera import log
from tessera.data.records import BadRecords, json_objects
from tessera.data.text import matching
from tessera.data.tokenizer import copy_tokenizer, load_tokenizer, tokenizer_source
from tessera.inputs import InputError

FORMAT = 1
INDEX = "index.json"
PLAN = "plan.json"
PIECE_BYTES = 64 << 20  # a jsonl piece: about this many bytes, cut at a line end


@dataclass(frozen=True)
class Piece:
    """One unit of work and its shard: ``kind`` text | jsonl | parquet | arrow; ``start``/``end``: a jsonl
    piece's byte range, a parquet piece's row group; ``line``: the line number ``start`` is at."""

    index: int
    path: str
    kind: str
    start: int = 0
    end: int = 0
    line: int = 1


@dataclass(frozen=True)
class Settings:
    """What decides the tokens: the same settings on a resumed run, or it is refused."""

    inputs: list[str]
    field: str
    tokenizer: str
    on_bad_record: str


def _kind(path: Path) -> str:
    if path.is_dir():
        return "arrow"
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def input_files(patterns: list[str]) -> list[Path]:
    """Paths and globs, in order; a ``datasets`` directory (``save_to_disk``) counts as one input."""
    found: list[Path] = []
    for pattern in patterns:
        matched = matching(pattern, lambda m: m.is_file() or (m / "state.json").is_file())
        if not matched:
            hint = " (a datasets directory holds state.json: save it with Dataset.save_to_disk)" if Path(
                pattern
            ).is_dir() else ""  # fmt: skip
            raise InputError(f"data prepare: '{pattern}' matches no file{hint}.")
        found.extend(Path(m) for m in matched)
    return found


def _arrow_files(folder: Path) -> list[Path]:
    try:
        state = json.loads((folder / "state.json").read_text())
        return [folder / f["filename"] for f in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"'{folder / 'state.json'}' is not a datasets state file ({exc}).") from None


def _check_column(path: Path, names: list[str], field: str) -> None:
    if field not in names:
        raise InputError(f"'{path}' has no column '{field}' (it has: {', '.join(names[:10])}): give --field.")


def plan_pieces(files: list[Path], field: str) -> list[Piece]:
    """Cut every input into pieces, checking parquet and arrow columns on the way."""
    pieces: list[Piece] = []
    for path in files:
        kind = _kind(path)
        if kind == "text":
            pieces.append(Piece(len(pieces), str(path), kind))
        elif kind == "jsonl":
            for start, end, line in _line_ranges(path):
                pieces.append(Piece(len(pieces), str(path), kind, start, end, line))
        elif kind == "parquet":
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(str(path))
            except Exception as exc:  # pyarrow's own error types
                raise InputError(f"'{path}' is not a parquet file ({exc}).") from None
            _check_column(path, meta.schema_arrow.names, field)
            pieces += [Piece(len(pieces) + g, str(path), kind, g, g + 1) for g in range(meta.num_row_groups)]
        else:
            import pyarrow as pa

            for file in _arrow_files(path):
                with pa.memory_map(str(file)) as source:
                    _check_column(file, pa.ipc.open_stream(source).schema.names, field)
                pieces.append(Piece(len(pieces), str(file), kind))
    return pieces


def _line_ranges(path: Path) -> list[tuple[int, int, int]]:
    """Byte ranges of about PIECE_BYTES ending at line ends, with the line each starts at."""
    size, ranges, start, line = path.stat().st_size, [], 0, 1
    with path.open("rb") as f:
        while start < size:
            f.seek(min(start + PIECE_BYTES, size))
            f.readline()  # to the end of the line the cut falls in
            end = min(f.tell(), size)
            f.seek(start)
            lines = f.read(end - start).count(b"\n")
            ranges.append((start, end, line))
            start, line = end, line + lines
    return ranges


# ----------------------------------------------------------------------------- one piece, in a worker
_TOKENIZER: Any = None


def _init_worker(tokenizer: str, threads: bool = True) -> None:
    global _TOKENIZER
    if not threads:  # a pool's workers: one thread each (the tokenizers library would use every core in each)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER = load_tokenizer(tokenizer)


def _records(piece: Piece, field: str, on_bad: str) -> tuple[list[str], int]:
    """The piece's documents, and how many records were skipped (``on_bad``: stop raises instead)."""
    docs, bad = [], BadRecords(on_bad)
    if piece.kind == "text":
        return [Path(piece.path).read_bytes().decode("utf-8", errors="replace")], 0
    if piece.kind == "jsonl":
        with open(piece.path, "rb") as f:
            f.seek(piece.start)
            lines = f.read(piece.end - piece.start).split(b"\n")
        for where, record in json_objects(lines, piece.path, bad, first_line=piece.line):
            value = record.get(field)
            if isinstance(value, str):
                docs.append(value)
            else:
                bad(where, f"no string field '{field}'")
        return docs, bad.skipped
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        values = pq.ParquetFile(piece.path).read_row_group(piece.start, columns=[field]).column(0).to_pylist()
    else:
        import pyarrow as pa

        with pa.memory_map(piece.path) as source:
            values = pa.ipc.open_stream(source).read_all().column(field).to_pylist()
    for row, value in enumerate(values):
        if isinstance(value, str):
            docs.append(value)
        else:
            bad(f"{piece.path} (row {row}{f' of row group {piece.start}' if piece.kind == 'parquet' else ''})",
                f"'{field}' is not a string")  # fmt: skip
    return docs, bad.skipped


def _tokenize(args: tuple[Piece, Path, str, str, str]) -> dict[str, int]:
    """Tokenize one piece into its shard (written beside, then renamed: a shard exists only whole)."""
    piece, out, field, on_bad, dtype = args
    docs, skipped = _records(piece, field, on_bad)
    end = _TOKENIZER.end_of_document
    if hasattr(_TOKENIZER, "encode_batch"):
        encoded = _TOKENIZER.encode_batch(docs)
    else:
        encoded = [_TOKENIZER.encode(d) for d in docs]
    tokens = np.fromiter((t for ids in encoded for t in [*ids, *end]), dtype=dtype)
    name = out / "shards" / f"{piece.index:06d}"
    tokens.tofile(f"{name}.bin.tmp")
    os.replace(f"{name}.bin.tmp", f"{name}.bin")
    counts = {"tokens": int(tokens.size), "documents": len(docs), "skipped": skipped}
    Path(f"{name}.json.tmp").write_text(json.dumps(counts))
    os.replace(f"{name}.json.tmp", f"{name}.json")
    return counts


# ----------------------------------------------------------------------------- the whole run
def prepare(
    inputs: list[str],
    out: str | Path,
    tokenizer: str = "bytes",
    field: str = "text",
    workers: int | None = None,
    on_bad_record: str = "stop",
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into shards under ``out``; resume a run interrupted with the same settings.
    Returns the index (also written to ``out/index.json``)."""
    BadRecords(on_bad_record)  # refuses a value other than stop or skip
    out = Path(out)
    spec = tokenizer if tokenizer == "bytes" else str(tokenizer_source(tokenizer, "--tokenizer").resolve())
    tok = load_tokenizer(spec)
    files = input_files(inputs)
    settings = Settings([str(f.resolve()) for f in files], field, spec, on_bad_record)
    _claim(out, settings)
    pieces = plan_pieces(files, field)
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    done = {p.index for p in pieces if (out / "shards" / f"{p.index:06d}.json").is_file()}
    todo = [p for p in pieces if p.index not in done]
    if spec != "bytes":
        copy_tokenizer(Path(spec), out / "tokenizer")  # the prepared folder carries its tokenizer, every file
    started, made = time.perf_counter(), 0
    bar = _Progress(len(pieces), len(done), progress)
    jobs = [(p, out, field, on_bad_record, dtype) for p in todo]
    # The tokenizers library already encodes a batch on every core: one process by default (2 processes ran
    # 0.89x as fast as 1 on 2 cores, docs/benchmarks.md); the byte tokenizer is Python: a process per core.
    default = 1 if spec != "bytes" else os.cpu_count() or 1
    workers = max(1, min(workers or default, len(todo) or 1))
    if workers == 1:
        _init_worker(spec)
        results = map(_tokenize, jobs)
        pool = None
    else:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(spec, False))
        results = pool.imap_unordered(_tokenize, jobs)
    try:
        for counts in results:
            made += counts["tokens"]
            bar(made / max(time.perf_counter() - started, 1e-9))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    return _write_index(out, pieces, tok, spec, dtype, settings)


def _claim(out: Path, settings: Settings) -> None:
    """Start ``out`` or resume it: refuse a folder holding another preparation or other files."""
    plan = out / PLAN
    if plan.is_file():
        before = json.loads(plan.read_text())
        if before != asdict(settings):
            raise InputError(
                f"'{out}' holds a preparation of other inputs or settings ({plan}): choose another --out, or "
                "delete it to start again."
            )
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out '{out}' exists and is not an empty folder: choose another.")
    (out / "shards").mkdir(parents=True, exist_ok=True)
    plan.write_text(json.dumps(asdict(settings), indent=1))


class _Progress:
    """Pieces done and tokens a second: a tqdm bar on a terminal; otherwise a log line at each tenth of the
    pieces (a batch system's log gets ten lines, not one per piece)."""

    def __init__(self, total: int, done: int, on: bool) -> None:
        self.total, self.done, self.on = total, done, on
        self.bar: Any = None
        if on and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=done, unit="piece", desc="data prepare", file=sys.stderr)

    def __call__(self, rate: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
            self.bar.update(1)
        elif self.on and (self.done * 10 // self.total > (self.done - 1) * 10 // self.total):
            log.get("data").info(f"data prepare: {self.done}/{self.total} pieces, {rate:,.0f} tokens/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_index(out: Path, pieces: list[Piece], tok: Any, spec: str, dtype: str, settings: Settings) -> dict:
    shards, totals = [], {"tokens": 0, "documents": 0, "skipped": 0}
    for piece in pieces:
        counts = json.loads((out / "shards" / f"{piece.index:06d}.json").read_text())
        if counts["tokens"]:
            shards.append({"file": f"shards/{piece.index:06d}.bin", **counts})
        for key in totals:
            totals[key] += counts[key]
    if totals["documents"] == 0:
        raise InputError(
            f"data prepare: the inputs hold no documents ({totals['skipped']} records skipped): "
            f"{', '.join(settings.inputs[:3])}."
        )
    index = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "tokenizer": "bytes" if spec == "bytes" else "tokenizer",  # a folder (earlier: tokenizer.json)
        "end_of_document": list(tok.end_of_document),
        **totals,
        "shards": shards,
        "inputs": settings.inputs,
        "field": settings.field,
    }
    (out / f"{INDEX}.tmp").write_text(json.dumps(index, indent=1))
    os.replace(out / f"{INDEX}.tmp", out / INDEX)
    return index
