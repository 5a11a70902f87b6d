"""Run inside a testbed seat (``enter.py SEATS traffic_probe PORT``), one rank on each of two nodes:
train a few steps under each layout and print, as one JSON line, what :mod:`tessera.traffic` counted
this rank sending between the nodes next to the bytes and packets the kernel says left its
interface meanwhile. ``PROBE_SEATS``: the testbed's seats file (rank 0's address hosts the store)."""

from __future__ import annotations

import json
import os
import sys

from tessera.testbed.seat import current_seat

STEPS = 3
LAYOUTS = ("ddp", "zero3")


def sent_bytes(interface: str) -> tuple[int, int]:
    """The kernel's count of bytes and packets sent through ``interface`` (this process's network namespace)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == interface:
                return int(fields.split()[8]), int(fields.split()[9])
    raise RuntimeError(f"no interface {interface} in /proc/self/net/dev")


def main() -> None:
    seat, port = current_seat(), sys.argv[1]
    with open(os.environ["PROBE_SEATS"]) as f:
        master = json.load(f)["seats"][0]["address"]
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=port, WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import tessera
    from tessera import traffic
    from tessera.models import Llama, LlamaConfig

    tessera.init(backend="gloo")
    out = {"rank": seat.rank}
    for layout in LAYOUTS:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192))
        plan = tessera.DDP() if layout == "ddp" else tessera.ZeRO(stage=3)
        booster = tessera.Booster(plan)
        model, optimizer = booster.boost(model, torch.optim.AdamW(model.parameters()))
        x = torch.randint(0, 256, (4, 33))
        dist.barrier()
        traffic.take()
        before = sent_bytes(seat.interface)
        for _ in range(STEPS):
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
        counted = traffic.take()
        after = sent_bytes(seat.interface)
        out[layout] = {
            "wire": after[0] - before[0],
            "packets": after[1] - before[1],
            **{k: v.bytes for k, v in counted.items()},
        }
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
