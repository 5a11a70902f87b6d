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


def _bytes_per_step(system: str, compiled: bool) -> tuple[float, int]:
    """What this rank's collectives sent in one training step (the second: set-up and the first step's
    compilation left out) of ``system``: Tessera's ZeRO-3, or ``fully_shard`` written by hand."""
    import torch
    import torch.distributed as dist
    from parity import build_model, loss_fn
    from torch.distributed.fsdp import fully_shard

    import tessera

    model = build_model("llama")
    x, y = torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16))
    if system == "tessera":
        booster = tessera.Booster(tessera.Plan(zero=3, compile="blocks" if compiled else "none"))
        model, opt = booster.boost(model, torch.optim.AdamW(model.parameters()))

        def step() -> None:
            booster.backward(loss_fn(model(x), y), opt)
            opt.step()
            opt.zero_grad()

    else:
        traffic.install()
        traffic.bind(["node"] * dist.get_world_size(), [0] * dist.get_world_size())
        for block in model.layers:
            if compiled:
                block.forward = torch.compile(block.forward, fullgraph=True)
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())

        def step() -> None:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    step()
    traffic.take()
    step()
    sent = traffic.take()["intra_node"]
    return sent.bytes, sent.collectives


def _sends_worker() -> dict:
    return {(system, compiled): _bytes_per_step(system, compiled) for system in ("by hand", "tessera")
            for compiled in (False, True)}  # fmt: skip


def test_tessera_zero3_sends_what_fully_shard_by_hand_sends() -> None:
    """Issue 34, item 3 (no overhead over FSDP2), where it can be checked exactly: a ZeRO-3 step moves the bytes
    and issues the collectives of ``fully_shard`` on each block and the root, written by hand, eager and with
    compiled blocks. (Tessera once resharded the root after forward and gathered it again in backward.)"""
    from tessera.testing import run_ranks

    sent = run_ranks(_sends_worker, 2, timeout_s=300)[0]
    for compiled in (False, True):
        assert sent[("tessera", compiled)] == sent[("by hand", compiled)], sent
        assert sent[("tessera", compiled)][0] > 0
