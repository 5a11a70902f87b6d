"""Every-step gradient averaging across ``Plan.groups``, hierarchically: each group reduce-scatters
a gradient bucket among its own ranks, the ranks holding the same slice in every group all-reduce
it across the slow link, and each group all-gathers the result. Only ``1 / group size`` of the
gradients crosses between groups, where a flat all-reduce over every rank would send all of it
around one ring that crosses the slow link.

For DDP (ZeRO-0/1) it is a DDP communication hook; FSDP (ZeRO-2/3) does the same natively when
given a 2-D (group, dp) mesh (HSDP: reduce-scatter in the shard dimension, all-reduce in the
replicate one), so :func:`~tessera.parallel.data_parallel.apply_data_parallel` just hands it that.

Example:
    >>> ddp.register_comm_hook(Hierarchy(inner=dp_group, across=group_pg), hierarchical_all_reduce)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against the real
# dist.GradBucket and torch.futures.Future types, not their names.
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Hierarchy:
    """``inner``: this rank's data-parallel group inside its group; ``across``: the ranks at the same
    place in every group."""

    inner: dist.ProcessGroup
    across: dist.ProcessGroup


def hierarchical_all_reduce(state: Hierarchy, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average ``bucket`` over every data-parallel rank of every group, in three steps.

    The steps run one after the other on the calling thread (no overlap of the three)."""
    buffer = bucket.buffer()
    n = dist.get_world_size(state.inner)
    total = n * dist.get_world_size(state.across)
    if n == 1:
        dist.all_reduce(buffer, group=state.across)
    else:
        pad = (-buffer.numel()) % n
        flat = torch.cat([buffer, buffer.new_zeros(pad)]) if pad else buffer
        piece = flat.new_empty(flat.numel() // n)
        dist.reduce_scatter_tensor(piece, flat, group=state.inner)
        dist.all_reduce(piece, group=state.across)
        dist.all_gather_into_tensor(flat, piece, group=state.inner)
        if pad:
            buffer.copy_(flat[: buffer.numel()])
    buffer.div_(total)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done
