"""The multi-rank helper fails clearly instead of hanging."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tessera.testing import run_ranks


def rank_times_ten() -> int:
    return dist.get_rank() * 10


def rank_one_never_arrives() -> None:
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))


def rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")


def test_results_come_back_in_rank_order() -> None:
    assert run_ranks(rank_times_ten, 3) == [0, 10, 20]


def test_a_missing_rank_times_out_with_a_message() -> None:
    start = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError), match="rank"):
        run_ranks(rank_one_never_arrives, 2, timeout_s=4)  # started from the forkserver, ranks are up in about a second
    assert time.monotonic() - start < 30


def test_a_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_ranks(rank_one_raises, 2)
