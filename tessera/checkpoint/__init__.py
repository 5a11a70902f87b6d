"""Checkpoints that survive crashes and load under another layout.

Model and optimizer state go through ``torch.distributed.checkpoint`` keyed by
parameter name (FQN), so a checkpoint written under DDP, ZeRO-1/2/3 or uneven
shares loads under any other of them, on another number of ranks. A save is
written to ``step_XXXXXXXX.tmp`` and renamed only when every rank finished, so
a crash mid-save never damages the last good checkpoint.

Layout of one checkpoint directory::

    step_00000100/
        .metadata, __*.distcp      DCP: {"model": ..., "optim": ...}
        trainer.pt                 step, data position, scheduler, loss scaler (rank 0)
        rng_rank{r}.pt             each rank's RNG states (restored when the world size matches)
        meta.json                  step, world size, run id, plan — written last: marks the checkpoint complete

A checkpoint may leave the frozen parameters out (``frozen=False``: LoRA's base, read again from its
pretrained files on resume): meta.json's ``frozen`` is then false and loading fills the others only.

What goes in besides the model is what the components give it (:mod:`.parts`): the optimizer's state
(torch's, ZeRO-1's, uneven experts' made whole), and under ``Plan.groups`` with an outer sync (diloco,
streaming, none) the groups' outer state, which also moves each group's state into a DCP folder of its
own, ``group_<g>/`` (each group's weights differ between syncs; :mod:`tessera.across.state`); meta.json's
``groups`` says how many. A checkpoint of one model resumes under such groups too (a warm start, as
DiLoCo starts from a pretrained model): every group reads the same weights and optimizer state, and the
outer sync begins there, its agreed weights those, with no outer momentum yet.

Checkpoints hold only data: every file is read through :mod:`.readers` (tensors,
numbers, strings, containers and DCP's metadata records), so a crafted file cannot run code on
``--resume``; it is refused.

- :mod:`.save` and :mod:`.load`: writing and reading; :mod:`.files`: finding complete checkpoints;
  :mod:`.parts`: what components give a checkpoint; :mod:`.storable`: DTensor layouts DCP can store;
  :mod:`.readers`: reading files as data only.
"""

from tessera.checkpoint.files import checkpoint_run_id, latest_checkpoint, list_checkpoints, run_checkpoints
from tessera.checkpoint.load import load_checkpoint
from tessera.checkpoint.readers import CheckpointError
from tessera.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "checkpoint_run_id",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "run_checkpoints",
    "save_checkpoint",
]
