"""Streaming DiLoCo's fragments: runs of the model's layers that sync on their own turns.

A :class:`Fragment` holds this rank's pieces of its parameters, the weights the groups last agreed on for
them (fp32, stepped by the outer optimizer), and the transfer in flight. With one fragment (plain DiLoCo)
it is the whole model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.across.compress import ErrorFeedback
from tessera.distributed import local
from tessera.errors import PlanError
from tessera.plan.groups import Groups


class Fragment:
    """A run of the model's layers (and the parameters beside them), synced on its own turn: its agreed
    weights, their outer optimizer, and the transfer in flight (its all-reduce, when its result is due,
    and the pieces as they were when it left)."""

    def __init__(self, params: dict[str, nn.Parameter], spec: Groups) -> None:
        self.names, self.params = list(params), list(params.values())
        self.pieces = [local(p) for p in self.params]
        self.agreed = [piece.detach().clone().float() for piece in self.pieces]  # fp32: the outer optimizer's
        self.optimizer = torch.optim.SGD(self.agreed, lr=spec.outer_lr, momentum=spec.outer_momentum,
                                         nesterov=spec.nesterov)  # fmt: skip
        self.flat: torch.Tensor | None = None
        self.part: torch.Tensor | None = None  # what this rank sends across: all of flat, or its replica's slice
        self.gathered: torch.Tensor | None = None  # compressed: every group's payload, in group order
        self.feedback = ErrorFeedback(spec.compression)
        self.work: Any = None
        self.total = 1.0  # the summed shares of the groups whose change the transfer averages
        self.due = 0
        self.sent: list[torch.Tensor] = []
        self.kept: bool | None = None  # the sync's fate when decided before it lands (at a checkpoint)

    @property
    def numel(self) -> int:
        """Values of this rank's pieces, all together."""
        return sum(a.numel() for a in self.agreed)

    def momentum(self) -> list[torch.Tensor] | None:
        """The outer optimizer's momentum of each piece, or None before its first step."""
        buffers = [self.optimizer.state.get(a, {}).get("momentum_buffer") for a in self.agreed]
        return buffers if all(m is not None for m in buffers) else None

    def set_momentum(self, values: list[torch.Tensor]) -> None:
        """Take ``values`` (one per piece) as the outer optimizer's momentum."""
        for agreed, value in zip(self.agreed, values):
            self.optimizer.state[agreed]["momentum_buffer"] = value.clone()

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The fragment's flat values as one tensor per piece."""
        return [t.view_as(a) for t, a in zip(flat.split([a.numel() for a in self.agreed]), self.agreed)]

    @torch.no_grad()
    def restart(self, agreed: list[torch.Tensor], due: int) -> None:
        """Agree on ``agreed`` (one tensor per piece) with no outer momentum, error feedback or transfer in
        flight; the next transfer is due at inner step ``due``."""
        for mine, value in zip(self.agreed, agreed):
            mine.copy_(value)
        self.optimizer.state.clear()
        self.feedback.remainder = None
        self.flat, self.part, self.gathered, self.work, self.sent, self.due = None, None, None, None, [], due
        self.kept = None


def fragment_of(names: list[str], blocks: list[str], fragments: int) -> list[int]:
    """Streaming DiLoCo's fragment of each parameter: the model's blocks (layers) in ``fragments`` equal
    runs, and every parameter outside them with the run it sits beside in the model's order (the
    embeddings with the first, the final norm and head with the last)."""
    if fragments == 1:
        return [0] * len(names)
    if not blocks or len(blocks) % fragments:
        raise PlanError(
            f"Plan.groups.fragments={fragments} must divide the model's {len(blocks)} layers (its repeated "
            f"blocks): each fragment is a run of whole layers; use a divisor of {len(blocks) or 'the layer count'}."
        )
    per = len(blocks) // fragments
    out, current = [], 0
    for name in names:
        block = next((i for i, prefix in enumerate(blocks) if name.startswith(prefix + ".")), None)
        if block is not None:
            current = block // per
        out.append(current)
    return out
