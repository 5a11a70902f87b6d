"""data.dataset (issue 33, item 6): rows read by the datasets library, from a load_dataset builder with local
files or a save_to_disk folder, become the same sequences the files they came from would: text rows as
data.paths files, instruction rows as data.instructions records. Mistakes name the field, before launch."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
import yaml

from tessera.config import ConfigError, parse_config
from tessera.data.instructions import InstructionData, records_key
from tessera.data.text import ByteTokenizer, PackedText
from tessera.inputs import InputError
from tessera.train.data import dataset_for

DOCS = [f"document {i}: " + "some words of text " * (3 + i % 5) for i in range(40)]
RECORDS = [{"prompt": f"Q{i}: what is {i} + 1?", "response": f"{i + 1}"} for i in range(30)]


def _config(data: dict, tmp_path: Path) -> object:
    return parse_config({"data": {"seq_len": 32, **data}, "logging": {"out_dir": str(tmp_path)}})


def test_text_rows_are_the_sequences_their_files_would_be(tmp_path: Path) -> None:
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    files = []
    for i, doc in enumerate(DOCS):
        files.append(tmp_path / f"doc{i:02d}.txt")
        files[-1].write_text(doc)
    from_files = PackedText([str(f) for f in files], 32, 4_000_000, 0, ByteTokenizer())
    cfg = _config({"dataset": {"path": "json", "data_files": [str(tmp_path / "docs.jsonl")]}}, tmp_path)
    from_rows = dataset_for(cfg, ByteTokenizer())
    assert isinstance(from_rows, PackedText) and torch.equal(from_rows.tokens, from_files.tokens)
    # max_bytes caps the text read, as it does for files
    capped = dataset_for(
        _config({"dataset": {"path": "json", "data_files": [str(tmp_path / "docs.jsonl")]}, "max_bytes": 500},
                tmp_path), ByteTokenizer())  # fmt: skip
    assert len(capped.tokens) == 500 and torch.equal(capped.tokens, from_files.tokens[:500])


def test_instruction_rows_from_a_save_to_disk_folder_are_the_records_of_a_jsonl_file(tmp_path: Path) -> None:
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    train, test = datasets.Dataset.from_list(RECORDS), datasets.Dataset.from_list(RECORDS[:3])
    splits = datasets.DatasetDict({"train": train, "test": test})
    splits.save_to_disk(str(tmp_path / "saved"))
    expected = InstructionData([str(tmp_path / "records.jsonl")], ByteTokenizer(), 32, pack=True)
    for source in (str(tmp_path / "saved"), {"path": str(tmp_path / "saved"), "split": "train"}):
        got = dataset_for(_config({"dataset": source, "pack": True}, tmp_path), ByteTokenizer())
        assert isinstance(got, InstructionData)
        assert all(torch.equal(a, b) for a, b in zip((got.x, got.y, got.documents), (expected.x, expected.y,
                                                                                     expected.documents)))  # fmt: skip
    test_split = dataset_for(_config({"dataset": {"path": str(tmp_path / "saved"), "split": "test"}}, tmp_path),
                             ByteTokenizer())  # fmt: skip
    assert len(test_split) == 3
    # The launcher reads and tokenizes the rows once, before launch, and hands its ranks the result.
    from tessera.data.instructions import HANDED_ENV
    from tessera.launch.preflight import check_training

    config = {"data": {"dataset": str(tmp_path / "saved"), "seq_len": 32}, "logging": {"out_dir": str(tmp_path)}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    checked = check_training(str(tmp_path / "c.yaml"), [], 1, 1, False)
    try:
        handed = InstructionData.saved(checked.env[HANDED_ENV], records_key(checked.cfg.data, None))
        assert handed is not None and torch.equal(handed.y, dataset_for(checked.cfg, ByteTokenizer()).y)
    finally:
        checked.close()


@pytest.mark.parametrize(
    "source,needle",
    [
        ({"path": "json", "data_files": ["nowhere.jsonl"]}, "data.dataset.data_files: 'nowhere.jsonl' does not exist"),
        ({"path": "SAVED", "split": "validation"}, "data.dataset.split='validation': SAVED holds the splits train"),
        ({"path": "json", "data_files": ["OTHER"]}, "has no column 'text' (data.dataset.text_field)"),
        ({"path": "./no/such/folder"}, "data.dataset.path='./no/such/folder' does not exist"),
        ({"path": "OTHER"}, "has no column 'text' (data.dataset.text_field)"),  # a data file, read by its builder
        ({"path": "csv", "data_files": ["OTHER"]}, "data.dataset: load_dataset('csv', name=None"),
    ],
)
def test_a_bad_dataset_is_named_before_launch(tmp_path: Path, source: dict, needle: str) -> None:
    from tessera.launch.preflight import check_training

    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "other.jsonl").write_text(json.dumps({"body": "a column not called text"}) + "\n")
    source = {k: v.replace("SAVED", str(tmp_path / "saved")) if isinstance(v, str) else v for k, v in source.items()}
    if source.get("data_files") == ["OTHER"]:
        source["data_files"] = [str(tmp_path / "other.jsonl")]
    if source["path"] == "OTHER":
        source["path"] = str(tmp_path / "other.jsonl")
    needle = needle.replace("SAVED", str(tmp_path / "saved"))
    config = {"data": {"dataset": source, "seq_len": 32}, "logging": {"out_dir": str(tmp_path)}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises((ConfigError, InputError)) as info:
        check_training(str(tmp_path / "c.yaml"), [], 1, 1, False)
    assert needle in str(info.value), str(info.value)


def test_dataset_is_the_only_source_of_training_data() -> None:
    with pytest.raises(ConfigError, match="data.dataset is the training data: leave data.paths"):
        parse_config({"data": {"dataset": "json", "paths": ["a.txt"]}})
    assert parse_config({"data": {"dataset": "some/folder"}}).data.dataset.path == "some/folder"
