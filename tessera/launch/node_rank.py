"""``tessera train --node-rank K``: this machine's place in a planned launch, whatever order the rendezvous
gives the machines.

torchrun's c10d rendezvous numbers machines in the order of their addresses, not in the order a plan needs
them, and a plan for mixed nodes puts each node's devices on its own block of ranks (an A100 node's ranks are
not an L4 node's). ``tessera plan`` prints each machine's ``--node-rank``; the launcher reads the plan's blocks
(``Plan.rank_devices``: each rank's ``node:index:type``, a node's ranks consecutive) and hands its ranks the
first plan rank of block K, and each rank takes ``that + LOCAL_RANK`` as its RANK before anything reads it
(:func:`take_planned_rank`). Machines may then hold different numbers of ranks, as the plan's nodes do.

Example::

    a0: tessera train run.yaml --set plan.file=plan.yaml --nproc 8 --nnodes 2 --node-rank 0 --rdzv-endpoint a0:29400
    l0: tessera train run.yaml --set plan.file=plan.yaml --nproc 4 --nnodes 2 --node-rank 1 --rdzv-endpoint a0:29400
"""

from __future__ import annotations

import os

from tessera.config import ConfigError
from tessera.plan import Plan

FIRST_RANK_ENV = "TESSERA_FIRST_RANK"  # the plan rank of this machine's local rank 0
NODE_RANK_ENV = "TESSERA_NODE_RANK"


def node_blocks(plan: Plan) -> list[tuple[str, int]]:
    """The plan's machines in rank order, each with its number of ranks (``rank_devices`` read in order)."""
    blocks: list[tuple[str, int]] = []
    for label in plan.rank_devices or ():
        node = label.split(":")[0].split("/")[0]  # a machine with two device types: "machine/type" nodes
        if blocks and blocks[-1][0] == node:
            blocks[-1] = (node, blocks[-1][1] + 1)
        else:
            blocks.append((node, 1))
    return blocks


def first_rank(plan: Plan, plan_file: str, node_rank: int, nproc: int, nnodes: int) -> int:
    """The plan rank of local rank 0 on the machine at ``node_rank``; a ConfigError when the launch does not
    match the plan's machines."""
    blocks = node_blocks(plan)
    if not blocks:
        raise ConfigError(
            f"--node-rank places this machine in a planned launch, but plan.file '{plan_file}' names no device per "
            "rank (Plan.rank_devices): use a plan written by `tessera plan`, or leave --node-rank out."
        )
    if len({node for node, _ in blocks}) != len(blocks):
        raise ConfigError(
            f"plan.file '{plan_file}' puts one machine's ranks in several blocks ({[n for n, _ in blocks]}): "
            "--node-rank needs each machine's ranks together; plan again with `tessera plan`."
        )
    if nnodes != len(blocks) or not 0 <= node_rank < len(blocks):
        raise ConfigError(
            f"--nnodes {nnodes} --node-rank {node_rank}: plan.file '{plan_file}' runs on {len(blocks)} machines "
            f"({', '.join(f'{k}: {n}' for k, (n, _) in enumerate(blocks))}): launch with --nnodes {len(blocks)} "
            f"and a --node-rank from 0 to {len(blocks) - 1}."
        )
    node, ranks = blocks[node_rank]
    if nproc != ranks:
        raise ConfigError(
            f"--node-rank {node_rank} is the plan's machine '{node}', which runs {ranks} ranks, but --nproc is "
            f"{nproc}: launch it with --nproc {ranks}."
        )
    return sum(n for _, n in blocks[:node_rank])


def take_planned_rank() -> str | None:
    """In a rank process: RANK becomes the plan's (this machine's first plan rank + LOCAL_RANK), GROUP_RANK
    the machine's --node-rank, when the launcher handed them; before anything reads RANK. Returns a line
    saying so for the machine's first rank to log (None otherwise)."""
    if FIRST_RANK_ENV not in os.environ or "LOCAL_RANK" not in os.environ:
        return None
    first, local = int(os.environ[FIRST_RANK_ENV]), int(os.environ["LOCAL_RANK"])
    given = os.environ.get("RANK", "?")
    os.environ["RANK"] = str(first + local)
    os.environ["GROUP_RANK"] = os.environ[NODE_RANK_ENV]
    if local:
        return None
    last = first + int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1
    return (
        f"machine {os.environ[NODE_RANK_ENV]} of the plan: ranks {first}..{last} (the rendezvous had numbered "
        f"this one's first rank {given})"
    )
