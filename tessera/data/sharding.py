"""Split each global batch across data-parallel ranks in proportion to their shares.

With shares ``(3, 1)`` and a global batch of 32, rank 0 takes the first 24
samples of every global batch and rank 1 the last 8. The union over ranks is
exactly the global batch a single process would see, so the layout never
changes the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tessera.errors import PlanError
from tessera.plan import split_batch


class ShareBatchSampler(Sampler[list[int]]):
    """Yields this rank's indices of each global batch; a new seeded shuffle every epoch."""

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        shares: Sequence[int],
        dp_rank: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        sizes = split_batch(global_batch_size, shares)
        if dataset_len < global_batch_size:
            raise PlanError(
                f"the dataset has {dataset_len} samples, fewer than one global batch of {global_batch_size}: "
                "lower global_batch_size or add data."
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.offset = sum(sizes[:dp_rank])
        self.local_batch_size = sizes[dp_rank]
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_batch = 0  # skip this many global batches of the epoch (resume)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch's shuffle; ``start_batch`` resumes mid-epoch."""
        self.epoch = epoch
        self.start_batch = start_batch

    def __len__(self) -> int:
        return self.dataset_len // self.global_batch_size  # the last partial global batch is dropped

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g)
        else:
            order = torch.arange(self.dataset_len)
        for b in range(self.start_batch, len(self)):
            start = b * self.global_batch_size + self.offset
            yield order[start : start + self.local_batch_size].tolist()


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor inside its dicts, lists and tuples."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


class ShardedLoader:
    """Iterates this rank's share of every global batch, already on the rank's device."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: ShareBatchSampler,
        device: torch.device,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        seq_slice: tuple[int, int] | None = None,
    ) -> None:
        """``seq_slice=(i, P)``: sequence parallelism; keep the i-th of P slices of dim 1 of every
        tensor with two or more dims (tokens and targets), so each rank sees its part of the sequence."""
        self.sampler = sampler
        self.device = device
        self.seq_slice = seq_slice
        self.loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=device.type == "cuda",
        )

    @property
    def global_batch_size(self) -> int:
        return self.sampler.global_batch_size

    @property
    def local_batch_size(self) -> int:
        return self.sampler.local_batch_size

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if self.seq_slice is not None:
                batch = slice_sequence(batch, *self.seq_slice)
            yield to_device(batch, self.device)


WHOLE_SEQUENCE = ("documents",)  # packed records' ids: every slice's attention mask spans the whole sequence


def slice_sequence(batch: Any, index: int, parts: int) -> Any:
    """The ``index``-th of ``parts`` equal slices of dim 1 of every tensor with two or more dims (of a dict
    batch, all but those named in ``WHOLE_SEQUENCE``)."""
    if isinstance(batch, dict):
        return {k: v if k in WHOLE_SEQUENCE else slice_sequence(v, index, parts) for k, v in batch.items()}

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2:
            return t
        if t.shape[1] % parts:
            raise PlanError(
                f"sequence length {t.shape[1]} does not divide by Plan.sp={parts}: use a sequence "
                "length that is a multiple of sp."
            )
        step = t.shape[1] // parts
        return t[:, index * step : (index + 1) * step]

    return map_tensors(batch, cut)
