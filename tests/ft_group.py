"""One group of a fault-tolerant DiLoCo run, as its own job (``python ft_group.py GROUP LIGHTHOUSE OUT DIE_AT
PACE REJOINED``): the tiny Llama, inner SGD, its half of every global batch, the outer sync through torchft.

After every outer sync it saves its weights (``OUT/g<GROUP>_<run>_step<N>.pt``) and appends a line to
``OUT/g<GROUP>.jsonl``: step, groups in the quorum, healed, committed, bytes sent across groups. At step
DIE_AT it exits abruptly (code 17), as a crashed machine would. It stops after REJOINED syncs of both
groups that follow a failure (a sync alone, or its own healing), so however long the crashed group takes
to come back, the other is still training; MAX_STEPS bounds it (exit 3: nobody came back).
PACE: seconds slept per step. FT_START_STEP starts it at that inner step, as a group resumed from a
checkpoint would; FT_SYNCS stops it after that many syncs; FT_START_TOGETHER (``g0_a,g1_a``) makes it wait
for those groups (the same list in each) to be up before its first step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from parity import TokenData, build_model, global_batches, loss_fn

import tessera
from tessera import traffic
from tessera.across.outer import OuterSync
from tessera.across.torchft import TorchftAcross
from tessera.faults import meet
from tessera.plan.groups import Groups

GROUPS, GLOBAL_BATCH, H, SGD_LR, MAX_STEPS = 2, 8, 2, 0.1, 600
SPEC = Groups(count=GROUPS, sync="diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.9)


def main() -> None:
    group, lighthouse, out = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    die_at, pace, rejoined = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
    run = os.environ.get("FT_RUN", "0")
    syncs = int(os.environ.get("FT_SYNCS", "0"))  # stop after this many syncs (0: after REJOINED, as above)
    tessera.init(backend="gloo")  # this group's own job: one rank, its own store
    model = build_model("llama")
    inner = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    across = TorchftAcross(group, lighthouse, timeout_s=20.0)
    outer = OuterSync(dict(model.named_parameters()), across, SPEC, [1 / GROUPS] * GROUPS, group)
    across.attach(outer)
    _start_together(out, os.environ.get("FT_START_TOGETHER", ""))
    outer.step = int(os.environ.get("FT_START_STEP", "0"))  # as a group resumed from a checkpoint at that step
    batches = list(global_batches(TokenData(), GLOBAL_BATCH, 64 // GLOBAL_BATCH))
    log = (out / f"g{group}.jsonl").open("a")
    failure_seen, together_since = False, 0
    while together_since < rejoined and (not syncs or len(across.syncs) < syncs):
        if outer.step >= MAX_STEPS:
            sys.exit(3)
        x, y = batches[outer.step % len(batches)]  # the step decides the batch: a healed group follows along
        loss = loss_fn(model(x.chunk(GROUPS)[group]), y.chunk(GROUPS)[group])
        loss.backward()
        inner.step()
        inner.zero_grad()
        outer.after_inner_step()
        if outer.step % H == 0:
            sent = traffic.take()["across_groups"].bytes  # this sync's (the job itself is one group)
            record = {"run": run, "step": outer.step, "sent": sent, **across.syncs[-1]}
            failure_seen = failure_seen or record["groups"] == 1 or record["healed"]
            together_since += failure_seen and record["groups"] == 2
            log.write(json.dumps(record) + "\n")
            log.flush()
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            torch.save(weights, out / f"g{group}_{run}_step{outer.step}.pt")
        if outer.step == die_at:
            os._exit(17)
        time.sleep(pace)
    across.shutdown()


def _start_together(out: Path, names: str) -> None:
    """Wait (after this group's torchft manager is up) until every group in ``names`` is up too: a group slow
    to start would otherwise find the other's first syncs already taken alone (RuntimeError after 120 s)."""
    if names:
        meet(len(names.split(",")), out / f"together_{names}", timeout_s=120)


if __name__ == "__main__":
    main()
