"""Held-out sequences for evaluation: the last ``data.validation`` share of the data, kept from training.

The launcher checks the split's sizes before any rank starts (:func:`check_held_out`, from the data's
length alone); each rank then splits its dataset the same way (:func:`split_validation`).
"""

from __future__ import annotations

import math

from torch.utils.data import Dataset, Subset

from tessera.config import ConfigError


def workable_shares(n: int, global_batch: int) -> tuple[float, float] | None:
    """The smallest and largest ``data.validation`` (in hundredths, under 0.5) that hold out at least a global
    batch of ``n`` sequences and leave at least one to train on; None when no share can."""
    low = math.ceil(global_batch / n * 100) / 100
    while int(n * low) < global_batch:  # floating point: 0.13 * 127 may fall just short
        low = round(low + 0.01, 2)
    high = min(math.floor((n - global_batch) / n * 100) / 100, 0.49)
    while high > 0 and n - int(n * high) < global_batch:
        high = round(high - 0.01, 2)
    return (low, high) if low <= high else None


def check_held_out(n: int, share: float, global_batch: int) -> int:
    """How many of ``n`` sequences the last ``share`` holds out; refused unless each side fills a global batch,
    the refusal giving the shares (or the global batch) that would work."""
    held = int(n * share)
    if not share or (held >= global_batch and n - held >= global_batch):
        return held
    head = (
        f"data.validation={share} holds out {held} of the data's {n} sequences, but the held-out and the training "
        f"sequences each need a whole global batch (train.global_batch_size={global_batch})"
    )
    if (shares := workable_shares(n, global_batch)) is not None:
        low, high = shares
        fits = f"data.validation: {low}" if low == high else f"data.validation between {low} and {high}"
        raise ConfigError(f"{head}: set {fits}, or lower train.global_batch_size.")
    largest = max((b for b in range(1, n) if workable_shares(n, b) is not None), default=0)
    fixes = f"lower train.global_batch_size to {largest} or less, " if largest else ""
    raise ConfigError(
        f"{head}, and {n} sequences cannot give both: {fixes}give more records or a shorter data.seq_len (more "
        "sequences), or set data.validation: 0 (no held-out loss)."
    )


def split_validation(dataset: Dataset, share: float, global_batch: int) -> tuple[Dataset, Dataset | None]:
    """The training sequences and the held-out ones (the last ``share`` of them; None when 0)."""
    if not share:
        return dataset, None
    n = len(dataset)  # type: ignore[arg-type]
    held = check_held_out(n, share, global_batch)
    return Subset(dataset, range(n - held)), Subset(dataset, range(n - held, n))
