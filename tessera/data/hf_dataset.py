"""``data.dataset``: training rows read by the ``datasets`` library.

A ``save_to_disk`` folder is read with ``load_from_disk``; a data file (``train.jsonl``, ``.csv``,
``.parquet``, ``.txt``) with the builder for its kind; anything else goes to ``load_dataset``: a builder with
local files (``{path: json, data_files: [a.jsonl, b.jsonl]}``), a folder of data files, or a Hub name where
the Hub is reachable. The rows' columns say what they are for:

- ``messages``, or ``prompt`` and ``response``: instruction records, fine-tuned on the responses only, as
  ``data.instructions`` files are (:class:`~tessera.data.instructions.InstructionData`);
- otherwise the ``text_field`` column (``text``): documents joined into sequences, as ``data.paths`` files
  are (:class:`~tessera.data.text.PackedText`).

Example (a config)::

    data:
      dataset: {path: json, data_files: [data/train.jsonl]}   # or a save_to_disk folder: dataset: data/ds
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from tessera.data.instructions import InstructionData
from tessera.data.text import PackedText
from tessera.inputs import InputError

# A data file given as data.dataset.path is read by the load_dataset builder for its kind.
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_rows(source: Any) -> Any:
    """The ``datasets.Dataset`` that ``source`` (a :class:`~tessera.config.DatasetSource`) names; a mistake is
    an :class:`InputError` naming the field."""
    try:
        import datasets
    except ImportError:
        raise InputError("data.dataset reads through the datasets library: pip install 'tessera[data]'.") from None
    datasets.disable_progress_bars()
    folder = Path(source.path)
    if folder.is_dir() and ((folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()):
        try:
            rows = datasets.load_from_disk(str(folder))
        except Exception as exc:  # datasets' own error types
            raise InputError(
                f"data.dataset.path={source.path!r} is not a readable save_to_disk folder ({exc})."
            ) from None
        if isinstance(rows, datasets.DatasetDict):
            if source.split not in rows:
                raise InputError(
                    f"data.dataset.split={source.split!r}: {source.path} holds the splits {', '.join(rows)}."
                )
            rows = rows[source.split]
        return rows
    path, files = source.path, source.data_files
    if (folder.suffix.lower() in BUILDERS or source.path.startswith((".", "/", "~"))) and not folder.exists():
        # a path, not a Hub name: said now, not after the Hub's retries
        raise InputError(f"data.dataset.path={source.path!r} does not exist.")
    if folder.suffix.lower() in BUILDERS and not files:  # a data file itself: its builder, reading it
        path, files = BUILDERS[folder.suffix.lower()], [source.path]
    for file in files or []:
        if not Path(file).exists():
            raise InputError(f"data.dataset.data_files: {file!r} does not exist.")
    try:
        return datasets.load_dataset(path, source.name, data_files=files, split=source.split)
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ValueError, its own)
        raise InputError(
            f"data.dataset: load_dataset({source.path!r}, name={source.name!r}, data_files={source.data_files!r}, "
            f"split={source.split!r}) failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
            "(a local file: give a builder and its files, e.g. {path: json, data_files: [train.jsonl]}; a folder "
            "written by save_to_disk: its path)."
        ) from None


def holds_instructions(rows: Any) -> bool:
    """Whether the rows are instruction records (``messages``, or ``prompt`` and ``response``)."""
    columns = set(rows.column_names)
    return "messages" in columns or {"prompt", "response"} <= columns


def dataset_data(source: Any, tokenizer: Any, seq_len: int, max_bytes: int, on_bad: str, pack: bool) -> Dataset:
    """The training sequences of ``source``'s rows: instruction records, or the text column joined."""
    rows = load_rows(source)
    label = f"{source.path}" + (f" ({', '.join(source.data_files)})" if source.data_files else "")
    if holds_instructions(rows):
        records = [{**row, "_where": f"{label} row {i}"} for i, row in enumerate(rows)]
        return InstructionData([label], tokenizer, seq_len, on_bad, pack=pack, records=records, field="data.dataset")
    if source.text_field not in rows.column_names:
        raise InputError(
            f"data.dataset {label} has no column {source.text_field!r} (data.dataset.text_field) for text, nor "
            f"'messages' or 'prompt' and 'response' for fine-tuning; its columns: {', '.join(rows.column_names)}."
        )
    if pack:
        raise InputError("data.pack packs instruction records, and data.dataset holds text: set data.pack: false.")
    texts = (text for text in rows[source.text_field] if isinstance(text, str))
    return PackedText.of_texts(texts, seq_len, max_bytes, tokenizer, f"data.dataset {label}")
