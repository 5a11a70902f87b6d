"""Entry point of one profiling rank: ``python -m tessera.planner.live.job CONFIG CLUSTER OUT``.

``tessera cluster profile`` launches one per cluster device (rank ``r`` plays device ``r``),
over the same launcher as ``tessera train`` (and, with ``--testbed``, in the testbed's seats).
Every rank measures its device and its links (:mod:`tessera.planner.live.measure`); rank 0
writes the live profile to OUT. Failures are reported like a training rank's.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

from tessera.errors import EXIT_OK
from tessera.launch.failures import Reporter

QUICK = {"repeats": 3, "window_s": 0.05}  # --quick: a smoke check's timings, not a planning profile


def profile(config: str, cluster_file: str, out: str, quick: bool = False) -> None:
    import torch
    import torch.distributed as dist

    import tessera
    from tessera.cluster.spec import Cluster
    from tessera.config import load_config, plan_from_config
    from tessera.distributed import pick_device, shutdown
    from tessera.models.build import build_model
    from tessera.planner.live.measure import (
        SIZES,
        all_reduce_gbs,
        collective_latency_us,
        fastest_two,
        measure_comm_overlap,
        measure_fsdp_overhead,
        measure_fsdp_pair,
        measure_links,
        measure_rank,
        measure_tensor_parallel,
        tensor_parallel_pair,
        whole_pass_seconds,
    )
    from tessera.planner.live.records import LiveProfile
    from tessera.planner.profile import model_key
    from tessera.testbed.seat import current_seat, verify_seat

    cfg = load_config(config, [])
    tessera.init(timeout_s=cfg.train.timeout_s)
    cluster = Cluster.load(cluster_file)
    rank, world = dist.get_rank(), dist.get_world_size()
    if (seat := current_seat()) is not None:
        print(f"TESTBED: {verify_seat(seat)}", flush=True)
    torch.manual_seed(cfg.train.seed)
    device = pick_device()
    model = build_model(cfg, weights=False).to(device)  # timed only: a pretrained model's weights are not read
    precision = plan_from_config(cfg.plan).precision
    timing: dict[str, Any] = QUICK if quick else {}
    sizes = tuple(sorted({min(b, cfg.train.global_batch_size) for b in SIZES}))
    first_pass = whole_pass_seconds(model, cfg.data.seq_len, device, **timing)
    mine = measure_rank(model, cluster, rank, cfg.data.seq_len, device, sizes, **timing)
    singletons = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    mine.fsdp_unit_s = measure_fsdp_overhead(model, cfg.data.seq_len, device, singletons[rank], **timing)
    speeds: list[Any] = [None] * world
    dist.all_gather_object(speeds, (mine.node, mine.block_s()))
    tensor_parallel = fsdp_pair = None
    if (pair := tensor_parallel_pair(speeds)) is not None:  # the fastest node's first two ranks
        node, members = pair
        group = dist.new_group(list(members))
        if rank in members:
            fsdp_pair = measure_fsdp_pair(model, cfg.data.seq_len, device, node, members, group, **timing)
            if _can_split_in_two(model):
                tensor_parallel = measure_tensor_parallel(
                    model, cfg.data.seq_len, device, node, members, group, sizes, **timing
                )
        dist.barrier()
    elif world >= 2:  # no node has two ranks: FSDP over the two fastest, across their link (else it looks free)
        members = fastest_two(speeds)
        group = dist.new_group(list(members))
        if rank in members:
            fsdp_pair = measure_fsdp_pair(model, cfg.data.seq_len, device, mine.node, members, group, **timing)
        dist.barrier()
    links = measure_links(cluster, list(range(world)), device)
    latency, bus = collective_latency_us(device), all_reduce_gbs(device)
    mine.comm_overlap = measure_comm_overlap(device) if world > 1 else 1.0
    mine.recheck_s = (first_pass, whole_pass_seconds(model, cfg.data.seq_len, device, **timing))  # the spread
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, tensor_parallel, fsdp_pair))
    if rank == 0:
        where = f"testbed {seat.cgroup.split('/')[-2]}" if seat is not None else socket.gethostname()
        tp = next((t for _, t, _ in gathered if t is not None), None)
        fsdp = _fsdp_pair([f for _, _, f in gathered if f is not None])
        ranks = [r for r, _, _ in gathered]
        live = LiveProfile(
            model_key(model), cfg.data.seq_len, precision, where, ranks, links, latency, bus, tp, dist.get_backend(),
            fsdp,
        )  # fmt: skip
        print(f"wrote {live.save(out)}", flush=True)
    shutdown()


def _fsdp_pair(measured: list[Any]) -> Any:
    """The FSDP pair's record: its first member's when both share a node; across two nodes, the slower
    member's (its partner's sharded step includes waiting for it), naming the other node."""
    if not measured:
        return None
    first = measured[0]
    if len({m.node for m in measured}) == 1:
        return first
    slower = max(measured, key=lambda m: m.plain_s)
    slower.across = next(m.node for m in measured if m is not slower)
    return slower


def _can_split_in_two(model: Any) -> bool:
    """Whether tensor parallelism over two ranks applies to ``model`` (else the profile times none)."""
    from tessera.errors import PlanError
    from tessera.models.policies import policy_for

    try:
        policy_for(model, "the profiler").check_tp(model, 2)
    except PlanError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tessera.planner.live.job")
    ap.add_argument("config")
    ap.add_argument("cluster")
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    reporter = Reporter()
    reporter.started()
    try:
        profile(args.config, args.cluster, args.out, args.quick)
    except BaseException as exc:  # noqa: BLE001 - every way a rank ends is reported
        return reporter.failed(exc, "profiling")
    reporter.finished()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
