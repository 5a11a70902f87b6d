"""Data: text corpora and tokenization, and splitting every global batch across data-parallel ranks."""

from tessera.data.sharding import ShardedLoader, ShareBatchSampler, split_batch
from tessera.data.text import ByteTokenizer, PackedText, default_corpus, resolve_paths

__all__ = [
    "ByteTokenizer",
    "PackedText",
    "ShardedLoader",
    "ShareBatchSampler",
    "default_corpus",
    "resolve_paths",
    "split_batch",
]
