"""The commands that launch jobs under torchrun: ``tessera train`` and ``tessera cluster profile``.

``tessera train`` parses the config once and resolves its plan once (:func:`~tessera.launch.preflight.
check_training`), then starts one job, one job in the testbed's seats, or a job per fault-tolerant group
(:mod:`.group_jobs`). Its ranks run :mod:`tessera.train.run`, named, never imported: the launcher side
does not import the rank side.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tessera import log
from tessera.cluster.spec import Cluster
from tessera.config import load_config, plan_from_config
from tessera.inputs import check_output_file
from tessera.launch import group_jobs
from tessera.launch.jobs import Launch, launch
from tessera.launch.preflight import Checked, check_training
from tessera.testbed import Testbed
from tessera.testbed.emulate import EMULATE_ENV, check_playable

RANK_MODULE = "tessera.train.run"  # what each training rank runs
PROFILE_MODULE = "tessera.planner.live.job"  # what each profiling rank runs


def train(args: argparse.Namespace) -> int:
    """``tessera train``: check everything, then launch."""
    emulated = Cluster.load(args.emulate) if args.emulate else None  # a malformed file named before the config
    if args.testbed and (args.emulate or args.nnodes > 1 or args.rdzv_endpoint):
        raise ValueError(
            "--testbed plays a cluster on this one machine: drop --emulate, --nnodes and --rdzv-endpoint with it."
        )
    checked = check_training(
        args.config, args.overrides, args.nproc, args.nnodes, args.overwrite, args.group, args.node_rank
    )
    if emulated is not None:  # every rank plays a device of the file: each one it plays must be there, and paced
        plan, world = checked.plan, args.nproc * args.nnodes
        try:
            check_playable(emulated, map(plan.device_of, range(world)), plan.precision, f"--emulate '{args.emulate}'")
        except BaseException:
            checked.close()
            raise
        # handed to the ranks (tessera.testbed.emulate.hooks_from_environment), never left in this process
        checked.env[EMULATE_ENV] = str(Path(args.emulate).resolve())
    rank_args = [args.config, *(f"--set={o}" for o in args.overrides), *(["--overwrite"] if args.overwrite else [])]
    if "LOCAL_RANK" not in os.environ and args.group is None:
        log.get("launch").info(checked.banner(args.nproc, args.nnodes))
    if "LOCAL_RANK" in os.environ:  # already a torchrun/SLURM-launched rank: become the rank
        checked.close()
        if EMULATE_ENV in checked.env:  # the emulated cluster goes with it (the handed records are gone)
            os.environ[EMULATE_ENV] = checked.env[EMULATE_ENV]
        os.execv(sys.executable, [sys.executable, "-m", RANK_MODULE, *rank_args])
    try:
        return _launch(args, checked, rank_args)
    finally:
        checked.close()


def _launch(args: argparse.Namespace, checked: Checked, rank_args: list[str]) -> int:
    cfg, groups = checked.cfg, checked.jobs[-1].groups
    if groups is not None and groups.fault_tolerant:  # one job per group, meeting through torchft
        if args.testbed or args.emulate:
            raise ValueError(
                "fault-tolerant plan.groups runs a job per group: --testbed and --emulate do not support it yet."
            )
        if args.group is not None:
            return group_jobs.launch_one_group(args, cfg, rank_args, checked.env)
        if args.nnodes > 1 or args.rdzv_endpoint:
            raise ValueError(
                "fault-tolerant plan.groups on several machines: start `tessera lighthouse`, then launch each group "
                "with --group G --lighthouse ADDRESS."
            )
        return group_jobs.launch_groups_here(args, groups)
    if args.group is not None:
        raise ValueError("--group launches one group of plan.groups with fault_tolerant: true; this config has none.")
    job = Launch(
        rank_args,
        cfg.run_dir,
        nproc=args.nproc,
        nnodes=args.nnodes,
        max_restarts=args.max_restarts,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        local_addr=args.local_addr,
        module=RANK_MODULE,
        env=checked.env,
    )
    if args.testbed:
        plan = checked.plan
        devices = [plan.device_of(r) for r in range(job.nproc)]
        return launch_on_testbed(job, args.testbed, devices, args.testbed_cpus, plan.precision)
    return launch(job)


def launch_on_testbed(job: Launch, cluster_file: str, devices: list[int], cpus: float | None, precision: str) -> int:
    """Launch ``job`` with rank ``r`` in the CPU cgroup and network namespace of cluster device ``devices[r]``."""
    with Testbed(Cluster.load(cluster_file), devices, cpus, precision) as bed:
        print(bed.describe(), file=sys.stderr)
        job.testbed_seats, job.testbed_master_addr = bed.seats_file, bed.master_addr
        code = launch(job)
        if traffic := bed.link_traffic():
            print(f"testbed {bed.name} links:\n{traffic}", file=sys.stderr)
        return code


def cluster_profile(args: argparse.Namespace) -> int:
    """``tessera cluster profile``: one rank per cluster device measures devices and links; rank 0 writes the
    live profile."""
    cluster = Cluster.load(args.cluster)
    cfg = load_config(args.config, [])
    nproc = args.nproc or cluster.world_size // args.nnodes
    if nproc * args.nnodes != cluster.world_size:
        raise ValueError(
            f"a profile needs one rank per device: the cluster file has {cluster.world_size} devices, the launch "
            f"{nproc * args.nnodes} ranks ({args.nnodes} node(s) x {nproc}); fix --nproc/--nnodes."
        )
    check_output_file(args.out, "--out", args.force)
    out = Path(args.out).resolve()
    job = Launch(
        [str(Path(args.config).resolve()), str(Path(args.cluster).resolve()), str(out)] + ["--quick"] * args.quick,
        out.parent,
        nproc=nproc,
        nnodes=args.nnodes,
        rdzv_endpoint=args.rdzv_endpoint,
        local_addr=args.local_addr,
        module=PROFILE_MODULE,
    )
    from tessera.planner.live.quiet import CpuWatch
    from tessera.planner.live.records import LiveProfile

    if args.testbed and args.nnodes > 1:
        raise ValueError("--testbed plays the cluster on this one machine: drop --nnodes with it.")
    with CpuWatch() as watch:  # were other processes using this machine while it was timed?
        if args.testbed:
            precision = plan_from_config(cfg.plan).precision
            code = launch_on_testbed(job, args.cluster, list(range(nproc)), args.testbed_cpus, precision)
        else:
            code = launch(job)
    if watch.busy:
        print(f"tessera: warning: {watch.warning()}", file=sys.stderr)
    if code == 0 and out.exists():  # rank 0 wrote it on this machine: the profile keeps what was seen
        LiveProfile.record_other_load(out, watch.others_cores)
    return code
