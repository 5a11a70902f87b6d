"""`tessera data prepare` and training from its shards (issue 15, item 3): text, jsonl, parquet and datasets
directories → token shards, by worker processes, resumable; training reads windows from disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from local_tokenizer import train_tokenizer

from tessera.data.prepare import prepare
from tessera.data.shards import TokenShards
from tessera.data.tokenizer import load_tokenizer
from tessera.inputs import InputError

TEXTS = [f"def f{i}(x):\n    return x * {i}  # ünïcode {i}\n" * (1 + i % 3) for i in range(40)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def _inputs(folder: Path) -> list[Path]:
    """The same 40 documents in four kinds of input, in order: a text file (document 0), a jsonl file with
    a blank line (1-14), a parquet file of two row groups (15-26), a datasets directory (27-39)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text(TEXTS[0])
    lines = [json.dumps({"content": t, "id": i}) for i, t in enumerate(TEXTS[1:15])]
    (folder / "b.jsonl").write_text("\n".join(lines[:5] + [""] + lines[5:]) + "\n")
    pq.write_table(pa.table({"content": TEXTS[15:27]}), folder / "c.parquet", row_group_size=6)
    Dataset.from_dict({"content": TEXTS[27:]}).save_to_disk(str(folder / "d"))
    return [folder / "a.txt", folder / "b.jsonl", folder / "c.parquet", folder / "d"]


def test_every_kind_of_input_becomes_the_documents_tokens_in_order(tokenizer: Path, tmp_path: Path) -> None:
    inputs = _inputs(tmp_path / "in")
    index = prepare([str(p) for p in inputs], tmp_path / "out", str(tokenizer), "content", workers=2, progress=False)
    tok = load_tokenizer(str(tokenizer))
    want = [t for text in TEXTS for t in [*tok.encode(text), *tok.end_of_document]]
    assert index["documents"] == 40 and index["tokens"] == len(want) and index["dtype"] == "uint16"
    assert len(index["shards"]) == 5  # text, jsonl, two row groups, the arrow file
    got = np.concatenate([np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint16) for s in index["shards"]])
    assert got.tolist() == want
    data = TokenShards(tmp_path / "out", seq_len=16)  # windows across shard boundaries
    assert len(data) == (len(want) - 1) // 16
    for i in (0, 7, len(data) - 1):
        item = data[i]
        assert item["x"].tolist() == want[i * 16 : i * 16 + 16] and item["y"].tolist() == want[i * 16 + 1 : i * 16 + 17]
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").read_text() == tokenizer.read_text()  # it carries it


def test_an_interrupted_preparation_resumes_with_the_pieces_left(tokenizer: Path, tmp_path: Path) -> None:
    inputs = [str(p) for p in _inputs(tmp_path / "in")]
    out = tmp_path / "out"
    first = prepare(inputs, out, str(tokenizer), "content", workers=1, progress=False)
    shards = sorted((out / "shards").glob("*.bin"))
    kept = {p: p.stat().st_mtime_ns for p in shards}
    (out / "index.json").unlink()  # as if stopped before the end: the last piece unfinished
    shards[-1].unlink()
    (out / "shards" / shards[-1].name.replace(".bin", ".json")).unlink()
    with pytest.raises(InputError, match="no index.json .*run `tessera data prepare` again"):
        TokenShards(out, 16)
    again = prepare(inputs, out, str(tokenizer), "content", workers=1, progress=False)
    assert again == first
    assert all(p.stat().st_mtime_ns == kept[p] for p in shards[:-1])  # the others were not tokenized again
    with pytest.raises(InputError, match="holds a preparation of other inputs or settings"):
        prepare(inputs, out, "bytes", "content", progress=False)


def test_bad_records_stop_with_file_and_line_or_are_skipped_and_counted(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"text": 2}\nnot json\n{"text": "four"}\n')
    with pytest.raises(InputError, match=r"bad.jsonl:2: no string field 'text'"):
        prepare([str(bad)], tmp_path / "a", progress=False)
    index = prepare([str(bad)], tmp_path / "b", on_bad_record="skip", progress=False)
    assert (index["documents"], index["skipped"]) == (2, 2)
    assert index["tokens"] == len("one") + len("four") + 2  # bytes, each document ended by a newline
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(InputError, match=r"c.parquet' has no column 'text' \(it has: body\): give --field"):
        prepare([str(tmp_path / "c.parquet")], tmp_path / "c", progress=False)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="the inputs hold no documents"):
        prepare([str(tmp_path / "empty.jsonl")], tmp_path / "d", progress=False)
    with pytest.raises(InputError, match="'nothing/\\*.jsonl' matches no file"):
        prepare(["nothing/*.jsonl"], tmp_path / "e", progress=False)


def test_tessera_data_prepare_then_train_from_the_shards(
    tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prepared by the CLI, trained from under ZeRO-2 on 2 ranks. (Its resume, bit for bit, was dropped for the
    suite's time in session 42: the shuffle's position lives in the sampler, whatever the dataset, and
    test_checkpoint's bitwise resume covers it.)"""
    import yaml
    from test_checkpoint import tiny_config

    from tessera.data.text import default_corpus

    def cli(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc.stdout

    from tessera.cli import main

    assert main(["data", "prepare", *default_corpus()[:30], "--tokenizer", str(tokenizer.parent), "--out",
                 str(tmp_path / "prepared"), "--workers", "2"]) == 0  # fmt: skip
    assert "30 documents, 30 shards" in capsys.readouterr().out
    config = tiny_config(tmp_path / "runs", 6, 0, {"preset": "zero", "zero": 2})
    config["data"] = {"prepared": str(tmp_path / "prepared"), "seq_len": 32}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    cli("train", str(tmp_path / "c.yaml"), "--nproc", "2")
    records = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)


CAP = 600 << 20  # bytes of memory for the training process, page cache included


@pytest.mark.skipif(not os.access("/sys/fs/cgroup/memory", os.W_OK), reason="needs the cgroup v1 memory controller")
def test_training_windows_stream_a_corpus_twice_the_memory_cap(tmp_path: Path) -> None:
    """A prepared corpus of 1.2 GB of tokens read window by window, in random order, by a process whose
    memory cgroup allows 600 MB: it reads every window and is not killed. (Reading the corpus into memory,
    as the text path does, needs 1.2 GB: the same process with ``np.fromfile`` is killed.)"""
    out = tmp_path / "big"
    (out / "shards").mkdir(parents=True)
    shards, per = [], 300_000_000
    for n in range(2):
        tokens = np.arange(per, dtype=np.uint32) % 50_000 + n  # 1.2 GB in all, a known pattern
        tokens.tofile(out / "shards" / f"{n:06d}.bin")
        shards.append({"file": f"shards/{n:06d}.bin", "tokens": per, "documents": 1, "skipped": 0})
    del tokens
    index = {"format": 1, "dtype": "uint32", "vocab_size": 50_001, "tokenizer": "bytes", "end_of_document": [10],
             "tokens": 2 * per, "documents": 2, "skipped": 0, "shards": shards, "inputs": [],
             "field": "text"}  # fmt: skip
    (out / "index.json").write_text(json.dumps(index))
    script = (
        "import sys, torch; from tessera.data.shards import TokenShards\n"
        f"data = TokenShards({str(out)!r}, seq_len=4095)\n"
        "if sys.argv[1] == 'whole': import numpy; whole = numpy.fromfile(data.files[0], dtype='uint32'); "
        "whole2 = numpy.fromfile(data.files[1], dtype='uint32'); print(int(whole[-1]) + int(whole2[-1]))\n"
        "order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))\n"
        "total = sum(int(data[int(i)]['x'][0]) for i in order)\n"
        "print(len(data), total)\n"
    )
    group = Path(f"/sys/fs/cgroup/memory/tessera_test_{os.getpid()}")
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(CAP))
        if (group / "memory.memsw.limit_in_bytes").exists():  # no swapping out of the cap either
            (group / "memory.memsw.limit_in_bytes").write_text(str(CAP))

        def run(mode: str) -> subprocess.CompletedProcess:
            enter = f'echo $$ > {group}/cgroup.procs && exec {sys.executable} -c "$0" {mode}'
            return subprocess.run(["bash", "-c", enter, script], capture_output=True, text=True, timeout=600)

        streamed = run("windows")
        assert streamed.returncode == 0, streamed.stderr[-2000:]
        count, total = map(int, streamed.stdout.split())
        starts = np.arange(count, dtype=np.int64) * 4095  # each window's first token: its shard's pattern
        first = np.where(starts < per, starts % 50_000, (starts - per) % 50_000 + 1)
        assert count == (2 * per - 1) // 4095 and total == int(first.sum())
        assert run("whole").returncode == -9  # the same cap kills (SIGKILL) a process holding the corpus
    finally:
        group.rmdir()
        shutil.rmtree(out)  # 1.2 GB
