"""How groups meet at an outer sync: the transport the outer step sends its averages through.

:class:`Across` is the protocol: begin a sync, all-reduce or all-gather over the groups taking part, and
commit it. :class:`MeshAcross` is the groups of one job, over the mesh's ``group`` axis (every group takes
part, always); :class:`tessera.across.torchft.TorchftAcross` is torchft's quorum, when each group is its own
job and may fail and come back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Across:
    """How the groups meet at an outer sync: :meth:`begin` it, all-reduce or all-gather over the groups
    taking part, :meth:`commit` it. The groups of one job always take part, every one of them."""

    def begin(self) -> bool:
        """Start a sync; False when this group has just taken the others' state (it brings no change)."""
        return True

    def size(self) -> int:
        """How many groups take part in this sync."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        """Sum ``tensor`` over the groups, in place; returns something to ``wait()`` on."""
        raise NotImplementedError

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        """Every group's ``tensor`` into ``out``, in group order; returns something to ``wait()`` on."""
        raise NotImplementedError

    def total_weight(self, weight: float) -> float:
        """The summed batch shares of the groups taking part (this one brings ``weight``)."""
        return 1.0

    def commit(self) -> bool:
        """Whether every group taking part got the sum (False: discard this sync)."""
        return True


class MeshAcross(Across):
    """The groups of one job, over the process group joining the ranks at one place in every group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce(self, tensor: torch.Tensor) -> Any:
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        return dist.all_gather_into_tensor(out, tensor, group=self.group, async_op=True)
