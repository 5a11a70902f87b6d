"""tessera.traffic's bookkeeping, without a process group: bytes always, time only when asked."""

from __future__ import annotations

import pytest

from tessera import traffic


def test_bytes_are_counted_always_and_timed_only_when_timing_is_on() -> None:
    counter = traffic._Counter()
    assert counter.add("inter_node", 1000.0) is None  # timing is off by default: no span, no callback
    counter.timing = True
    span = counter.add("inter_node", 500.0)
    assert span is not None
    span[1] = span[0] + 2.0  # the collective finished two seconds after its issue
    unfinished = counter.add("inter_node", 250.0)  # still in flight at take(): its time comes later
    sent = counter.take()["inter_node"]
    assert (sent.bytes, sent.collectives, sent.timed_bytes) == (1750.0, 3, 500.0)
    assert sent.busy_s == pytest.approx(2.0)
    assert sent.gbit_s == pytest.approx(500.0 * 8 / 2.0 / 1e9)  # the finished timed bytes over their busy time
    unfinished[1] = unfinished[0] + 1.0
    later = counter.take()["inter_node"]
    assert (later.bytes, later.timed_bytes, later.busy_s) == (0.0, 250.0, pytest.approx(1.0))
    assert counter.take()["intra_node"].gbit_s is None


def test_overlapping_collectives_count_their_busy_time_once() -> None:
    assert traffic._union_length([[0.0, 2.0], [1.0, 3.0], [5.0, 6.0]]) == pytest.approx(4.0)
