"""The data a training config reads, on a rank: instruction records (read from the launcher's hand-on when
it tokenized them already), prepared token shards, a ``datasets`` dataset's rows, or text packed into
sequences; split into training and held-out sequences."""

from __future__ import annotations

import os

from torch.utils.data import Dataset

from tessera.config import Config
from tessera.data.held_out import split_validation
from tessera.data.hf_dataset import dataset_data
from tessera.data.instructions import HANDED_ENV, InstructionData, records_key
from tessera.data.shards import TokenShards
from tessera.data.text import PackedText, resolve_paths


def dataset_for(cfg: Config, tokenizer: object) -> Dataset:
    """The whole dataset ``cfg.data`` describes, tokenized with ``tokenizer``."""
    d = cfg.data
    if d.instructions:
        handed = os.environ.get(HANDED_ENV)
        if handed and (data := InstructionData.saved(handed, records_key(d, cfg.model.pretrained))) is not None:
            return data
        return InstructionData(resolve_paths(d.instructions), tokenizer, d.seq_len, d.on_bad_record, pack=d.pack)
    if d.dataset is not None:
        handed = os.environ.get(HANDED_ENV)  # instruction rows: the launcher tokenized them already
        if handed and (data := InstructionData.saved(handed, records_key(d, cfg.model.pretrained))) is not None:
            return data
        return dataset_data(d.dataset, tokenizer, d.seq_len, d.max_bytes, d.on_bad_record, d.pack)
    if d.prepared:
        return TokenShards(d.prepared, d.seq_len)
    return PackedText(resolve_paths(d.paths), d.seq_len, d.max_bytes, 0, tokenizer)


def training_data(cfg: Config, tokenizer: object) -> tuple[Dataset, Dataset | None]:
    """The training sequences and the held-out ones (None without ``data.validation``)."""
    return split_validation(dataset_for(cfg, tokenizer), cfg.data.validation, cfg.train.global_batch_size)
