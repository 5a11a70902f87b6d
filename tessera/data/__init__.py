"""Data loading: splitting every global batch across data-parallel ranks."""

from tessera.data.sharding import ShardedLoader, ShareBatchSampler, split_batch

__all__ = ["ShardedLoader", "ShareBatchSampler", "split_batch"]
