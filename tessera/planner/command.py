"""``tessera plan``: plan a training config's model on a cluster (the best plans as a table, plan 0 as a Plan
file and a picture, and how to launch it), or check a Plan file for a number of ranks."""

from __future__ import annotations

import argparse
import shlex
from collections import Counter
from pathlib import Path

import torch

from tessera.cluster.spec import Cluster
from tessera.config import load_config, plan_from_config
from tessera.inputs import check_output_file
from tessera.models.build import build_model
from tessera.plan import Plan
from tessera.planner import ModelCosts, plan_for
from tessera.planner.draw import draw
from tessera.planner.layout import ranks_of
from tessera.planner.live.inputs import measured_cluster, measured_costs
from tessera.planner.live.quiet import BUSY_CORES, busy_warning
from tessera.planner.live.records import LiveProfile
from tessera.planner.outer import region_cluster, regions_of
from tessera.planner.precision import choose_precision


def check_plan_file(args: argparse.Namespace) -> int:
    """``tessera plan check``: a Plan file resolved for ``--world-size`` ranks (the file's own by default),
    printed back."""
    plan, recorded = Plan.load_file(args.file)
    world = args.world_size or recorded
    if world is None:
        raise ValueError(f"Plan file '{args.file}' records no world_size: give --world-size N.")
    plan = plan.resolve(world)
    print(plan.to_yaml(), end="")
    print(f"# valid for {world} ranks")
    return 0


def plan(args: argparse.Namespace) -> int:
    """Plan a training config's model on a cluster: table, Plan file, picture."""
    if not (args.model and args.cluster and args.global_batch):
        raise ValueError("tessera plan needs --model CONFIG.yaml --cluster CLUSTER.yaml --global-batch N.")
    cfg = load_config(args.model, [])
    cluster = Cluster.load(args.cluster)
    check_output_file(args.out, "--out", force=True)  # plan files are outputs: rewritten, but must be writable
    check_output_file(args.png, "--png", force=True)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = build_model(cfg)
    requested = args.precision or plan_from_config(cfg.plan).precision
    precision, precision_note = choose_precision(cluster, requested, args.pin_precision)
    costs = ModelCosts.from_model(model, cfg.data.seq_len, precision)
    spread = 0.0
    if args.profile:  # plan from what `tessera cluster profile` measured, not from declared figures
        live = LiveProfile.load(args.profile)
        if live.other_cpu_cores > BUSY_CORES:
            print(f"warning: {args.profile}: {busy_warning(live.other_cpu_cores)}")
        spread = live.spread
        cluster, costs = measured_cluster(cluster, live), measured_costs(live, costs)
    found = plan_for(
        cluster, model, args.global_batch, precision=precision, top=args.top, costs=costs, pin_precision=True
    )  # the precision is settled above (with its note on the best candidate when it was chosen)
    print(
        f"{len(found)} best plans for {costs.name} ({costs.source} costs, seq {costs.seq_len}, {costs.precision}) "
        f"on {cluster.world_size} devices, global batch {args.global_batch}:"
    )
    print(
        f"{'#':>2} {'s/step':>9} {'tokens/s':>11} {'dp':>3} {'tp':>3} {'pp':>3} {'zero':>4} {'mb':>3} "
        f"{'recompute':>9} {'mem':>5}  placement / bottleneck"
    )
    for i, c in enumerate(found):
        p, e = c.plan, c.estimate
        fullest = max(m.total / m.capacity for m in e.memory)
        own = p.groups is not None and p.groups.layouts is not None  # each group its own layout: lines below
        dp, pp = (len(p.replicas), "mix") if p.replicas else ("-", "-") if own else (p.dp, p.pp)
        tp, zero, mb, rc = ("-",) * 4 if own else (p.tp, p.zero, p.pipeline.microbatches, p.recompute)
        if p.replicas and any(r.tp > 1 for r in p.replicas):
            tp = "mix"
        print(
            f"{i:>2} {e.step_s:>9.4g} {e.tokens_per_s:>11,.0f} {dp:>3} {tp:>3} {pp:>3} {zero:>4} "
            f"{mb:>3} {rc:>9} {fullest:>5.0%}  {c.placement}; {e.bottleneck}"
        )
        if own:
            assert p.groups is not None
            for g in range(p.groups.count):
                q = p.group_plan(g)
                print(
                    f"{'':>3} group {g}: {(p.groups.sizes or ())[g]} ranks, {(p.groups.shares or ())[g]} samples: "
                    f"tp{q.tp} pp{q.pp} ZeRO-{q.zero} m{q.pipeline.microbatches} recompute {q.recompute}, shares "
                    f"{q.dp_shares or 'even'}"
                )  # fmt: skip
        if p.replicas:
            print(f"{'':>3} replicas (share: stages) " + "; ".join(_replica_line(r) for r in p.replicas))
        elif not own and (p.dp_shares or p.pipeline.stages):
            print(
                f"{'':>3} shares {summary(p.dp_shares) if p.dp_shares else 'even'}; stages {p.pipeline.stages or 'one'}"
            )
        if p.ep > 1:
            held = list(p.expert_shares) if p.expert_shares else "evenly"
            print(f"{'':>3} experts over ep={p.ep} ranks, held {held}")
        if p.groups is not None:  # dp, tp and the shares above are each group's
            g = p.groups
            every = f"every {g.inner_steps} steps" + (f", {g.fragments} fragments in turn" if g.fragments > 1 else "")
            print(
                f"{'':>3} groups: {g.count} (a region each), sync {g.sync}"
                + ("" if g.sync == "every_step" else f" {every}")
            )
    best = found[0]
    if spread:
        print(f"note: {_ties(found, spread)}")
    for line in ([precision_note] if precision_note else []) + list(best.notes):
        print(f"note: {line}")
    batch = args.global_batch if args.global_batch != cfg.train.global_batch_size else None
    print_launch(best.plan, cluster, args.out, args.model, batch)
    best.plan.save(args.out, world_size=cluster.world_size)
    print(f"wrote {args.out} (plan 0; mem = fullest device's share of its usable memory)")
    print(f"wrote {draw(best, cluster, costs, args.png)}")
    return 0


def _ties(found: list, spread: float) -> str:
    """What the profile's own spread says about the table: which plans it cannot tell from plan 0."""
    tied = [i for i, c in enumerate(found) if c.estimate.step_s <= found[0].estimate.step_s * (1 + spread)]
    told = (
        f"plans {', '.join(map(str, tied))} are predicted within it of plan 0: a profile taken again may rank them "
        "in another order, and any of them is as good a pick as this profile can tell"
        if len(tied) > 1
        else "no other plan is predicted within it of plan 0"
    )
    return f"the profile's own spread is {spread:.1%} (the same pass timed at its start and end); {told}."


SHOWN_WHOLE = 8  # longer tuples of shares are summarised in the table (the plan file has them whole)


def _replica_line(replica) -> str:
    """One replica of a Plan.replicas plan: its share and stages, and its tp when it has one."""
    return f"{replica.share}: {list(replica.stages)}" + (f" tp{replica.tp}" if replica.tp > 1 else "")


def summary(values: tuple[int, ...]) -> str:
    """``values`` as they are when short; else how many, their range and the commonest, e.g.
    ``512 ranks, 3..5 samples: 256x 4, 200x 3, 56x 5``."""
    if len(values) <= SHOWN_WHOLE:
        return str(values)
    common = Counter(values).most_common()
    shown = ", ".join(f"{n}x {v}" for v, n in common[:4]) + (", ..." if len(common) > 4 else "")
    return f"{len(values)} ranks, {min(values)}..{max(values)} samples: {shown}"


CONSOLE_LAUNCH_NODES = 4  # more nodes than this: one line per node in a file, a summary on the console


RENDEZVOUS_PORT = 29400  # torchrun's default
LIGHTHOUSE_PORT = 29510  # tessera lighthouse's default


def print_launch(plan, cluster, out: str, config: str = "CONFIG", global_batch: int | None = None) -> None:
    """How to launch plan 0: one complete ``tessera train`` command per machine (``config`` with ``--set
    plan.file=out``, and the batch it was planned for when that is not the config's: ``global_batch``), each
    with the ``--node-rank`` that gives its ranks that machine's plan ranks (:mod:`tessera.launch.node_rank`),
    all meeting at the first machine's rendezvous. Up to a few machines on the console; more in
    ``<out>.launch.txt``, one command per line, with a script and a host file a scheduler takes.
    Fault-tolerant groups: a Lighthouse, and each group its own job (its own rendezvous, files per group)."""
    if len(cluster.nodes) == 1:
        return
    train = f"tessera train {config} --set plan.file={out}"
    if global_batch is not None:
        train += f" --set train.global_batch_size={global_batch}"
    if plan.groups is not None and plan.groups.fault_tolerant:  # a job per group, meeting through a Lighthouse
        _print_group_launch(plan, cluster, out, train)
        return
    order, ranks = _machines(plan, cluster)
    commands = _commands(train, order, ranks)
    where = f"(machine names stand for their addresses; the rendezvous is on {order[0]})"
    if len(order) <= CONSOLE_LAUNCH_NODES:
        print(f"launch plan 0, one command per machine {where}:\n  " + "\n  ".join(_lines(order, commands)))
        return
    path, script, hosts = _launch_files(out, order, commands)
    print(
        f"launch plan 0 on {len(order)} machines ({ranks_of(plan, cluster)} ranks): one command per machine in "
        f"{path} (first {order[0]} --node-rank 0, last {order[-1]} --node-rank {len(order) - 1}) {where}; or run "
        f"`bash {script}` on every machine (e.g. `srun --nodes {len(order)} --ntasks-per-node 1 bash {script}`), "
        f"machines in {hosts}"
    )


def _machines(plan, cluster) -> tuple[list[str], list[int]]:
    """The machines in the order ``plan``'s ranks reach them, and how many consecutive ranks each runs."""
    devices = cluster.devices()
    order: list[str] = []
    ranks: list[int] = []
    for rank in range(ranks_of(plan, cluster)):
        host = cluster.node(devices[plan.device_of(rank)][0]).host
        if order and order[-1] == host:
            ranks[-1] += 1
        else:
            order.append(host)
            ranks.append(1)
    return order, ranks


def _commands(train: str, order: list[str], ranks: list[int]) -> list[str]:
    """One command per machine of a job: its ranks, its --node-rank, the job's rendezvous on its first."""
    endpoint = f"{order[0]}:{RENDEZVOUS_PORT}"
    return [
        f"{train} --nproc {n} --nnodes {len(order)} --node-rank {k} --rdzv-endpoint {endpoint}"
        for k, n in enumerate(ranks)
    ]


def _print_group_launch(plan, cluster, out: str, train: str) -> None:
    """A Lighthouse on group 0's first machine, then each group's job on its region's machines (with the
    group's own plan and rendezvous); many machines: per group a command file, a script and a host file."""
    assert plan.groups is not None
    jobs = [
        _machines(plan.group_plan(g), region_cluster(cluster, nodes)) for g, nodes in enumerate(regions_of(cluster))
    ]
    home = jobs[0][0][0]
    url = f"http://{home}:{LIGHTHOUSE_PORT}"
    lighthouse = f"{home}: tessera lighthouse --bind {home}:{LIGHTHOUSE_PORT}"
    machines = sum(len(order) for order, _ in jobs)
    head = (
        f"launch plan 0 as one job per group (machine names stand for their addresses): first the Lighthouse every "
        f"group dials,\n  {lighthouse}\nthen each group's machines"
    )
    per_group = []
    for g, (order, ranks) in enumerate(jobs):
        commands = _commands(f"{train} --group {g} --lighthouse {url}", order, ranks)
        if machines <= CONSOLE_LAUNCH_NODES:
            per_group.append(f"group {g} (its rendezvous on {order[0]}):\n  " + "\n  ".join(_lines(order, commands)))
        else:
            path, script, hosts = _launch_files(out, order, commands, f".group{g}")
            per_group.append(
                f"group {g}: {len(order)} machines ({sum(ranks)} ranks, rendezvous on {order[0]}): one command per "
                f"machine in {path}, or `bash {script}` on each of the machines in {hosts}"
            )
    print(head + ":\n" + "\n".join(per_group))


def _lines(machines: list[str], commands: list[str]) -> list[str]:
    """``machine: command``, one per machine."""
    return [f"{host}: {command}" for host, command in zip(machines, commands)]


def _launch_files(out: str, machines: list[str], commands: list[str], part: str = "") -> tuple[Path, Path, Path]:
    """``<out><part>.launch.txt`` (one ``machine: command`` line each), its script and its host file."""
    path = Path(out).with_suffix(f"{part}.launch.txt")
    check_output_file(str(path), "the launch file", force=True)
    path.write_text("\n".join(_lines(machines, commands)) + "\n")
    script, hosts = _launch_script(out, machines, commands, part)
    return path, script, hosts


def _launch_script(out: str, machines: list[str], commands: list[str], part: str = "") -> tuple[Path, Path]:
    """``<out><part>.launch.sh``, which runs the command of the machine it runs on (its short hostname, or the
    name given as its argument), and ``<out><part>.hosts``, the machines in --node-rank order: what a scheduler
    takes."""
    hosts, script = Path(out).with_suffix(f"{part}.hosts"), Path(out).with_suffix(f"{part}.launch.sh")
    for path in (hosts, script):
        check_output_file(str(path), "the launch file", force=True)
    hosts.write_text("\n".join(machines) + "\n")
    arms = "\n".join(f"  {shlex.quote(m)}) exec {command} ;;" for m, command in zip(machines, commands))
    script.write_text(
        "#!/usr/bin/env bash\n# Plan 0's launch: run on every machine of the plan (written by `tessera plan`).\n"
        'machine="${1:-$(hostname -s)}"\ncase "$machine" in\n'
        f"{arms}\n"
        f'  *) echo "tessera: $machine is not one of the plan\'s machines ({hosts.name})" >&2; exit 2 ;;\nesac\n'
    )
    return script, hosts
