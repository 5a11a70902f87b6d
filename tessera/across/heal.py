"""What a group coming back takes from a live one (torchft heals it at the next quorum).

Groups laid out alike hand over rank for rank: the inner step count, each fragment's agreed weights and
outer momentum, and the weights themselves (:func:`heal_state`). Groups that differ in size or layout hold
different pieces, so they hand over canonical slots instead (:func:`slot_heal_state`), and the group coming
back cuts its own pieces from them. Error feedback's remainder stays behind: it is each group's own.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.across.outer import OuterSync


def heal_state(outer: OuterSync) -> dict[str, Any]:
    """What a group coming back takes from ``outer``'s, rank for rank (same layout, so local pieces)."""
    fragments = []
    for fragment in outer.fragments:
        momentum = fragment.momentum()
        fragments.append({
            "agreed": [a.clone() for a in fragment.agreed],
            "momentum": [m.clone() for m in momentum] if momentum is not None else None,
            "pieces": [piece.detach().clone() for piece in fragment.pieces],
        })  # fmt: skip
    return {"step": outer.step, "due": [f.due for f in outer.fragments], "fragments": fragments}


@torch.no_grad()
def load_heal_state(outer: OuterSync, state: dict[str, Any]) -> None:
    """Continue ``outer`` from a live group's :func:`heal_state`."""
    outer.step = int(state["step"])
    for fragment, saved, due in zip(outer.fragments, state["fragments"], state["due"]):
        fragment.restart(saved["agreed"], due)
        for piece, value in zip(fragment.pieces, saved["pieces"]):
            piece.copy_(value)
        fragment.set_momentum(saved["momentum"] or [])


@torch.no_grad()
def slot_heal_state(outer: OuterSync) -> dict[str, Any]:
    """What a group coming back takes from ``outer``'s when they differ: the inner step count, and this rank's
    slot of each fragment's agreed weights and outer momentum. Every rank of the group calls it together
    (a sharded group gathers each parameter to cut its slot)."""
    fragments = []
    for fragment in outer.fragments:
        flats = {"agreed": torch.cat([a.flatten() for a in fragment.agreed])}
        if (momentum := fragment.momentum()) is not None:
            flats["momentum"] = torch.cat([m.flatten() for m in momentum])
        fragments.append({k: outer.slicing.slice(v, fragment) for k, v in flats.items()})
    return {"step": outer.step, "due": [f.due for f in outer.fragments], "fragments": fragments}


@torch.no_grad()
def load_slot_heal_state(outer: OuterSync, state: dict[str, Any] | None, shape: dict[str, Any]) -> None:
    """Continue ``outer`` from a live group's :func:`slot_heal_state`, which this rank holds if it has a slot
    (else None); ``shape`` (the same on every rank of the group): its step, each fragment's due step and
    whether it carries momentum. Every rank of the group calls it together; each takes its pieces from the
    slots."""
    outer.step = int(shape["step"])
    for f, fragment in enumerate(outer.fragments):
        blank = fragment.agreed[0].new_zeros(outer.slicing.slot_size(fragment))
        slots = state["fragments"][f] if state is not None else {}
        agreed = fragment.split(outer.slicing.whole(slots.get("agreed", blank), fragment.numel, fragment))
        fragment.restart(agreed, int(shape["due"][f]))
        for piece, value in zip(fragment.pieces, agreed):
            piece.copy_(value)
        if shape["momentum"][f]:
            fragment.set_momentum(fragment.split(outer.slicing.whole(slots.get("momentum", blank), fragment.numel,
                                                                      fragment)))  # fmt: skip
