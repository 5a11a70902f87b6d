"""Held-out sequences for evaluation: the last ``data.validation`` share of the data, kept from training.

The launcher checks the split's sizes before any rank starts (:func:`check_held_out`, from the data's
length alone); each rank then splits its dataset the same way (:func:`split_validation`).
"""

from __future__ import annotations

from torch.utils.data import Dataset, Subset

from tessera.config import ConfigError


def check_held_out(n: int, share: float, global_batch: int) -> int:
    """How many of ``n`` sequences the last ``share`` holds out; refused unless each side fills a global batch."""
    held = int(n * share)
    if share and (held < global_batch or n - held < global_batch):
        raise ConfigError(
            f"data.validation={share} holds out {held} of the data's {n} sequences, but each side needs a global "
            f"batch (train.global_batch_size={global_batch}): change data.validation or add data."
        )
    return held


def split_validation(dataset: Dataset, share: float, global_batch: int) -> tuple[Dataset, Dataset | None]:
    """The training sequences and the held-out ones (the last ``share`` of them; None when 0)."""
    if not share:
        return dataset, None
    n = len(dataset)  # type: ignore[arg-type]
    held = check_held_out(n, share, global_batch)
    return Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))
