"""Groups that survive failures: the outer sync of ``Plan.groups`` through torchft.

Each group is its own job (its own ``torchrun``, its own ranks 0…n−1) and every rank of it runs a
torchft ``Manager``. A Lighthouse (one small server for the whole run) forms a quorum of the groups
that are alive at each outer sync:

- a group that dies drops out of the quorum (its heartbeats stop) and the others carry on, the
  average taken over the groups that sent (weighted by their batch shares);
- a group that comes back (or starts late) joins the next quorum, takes the current state from a
  live group (the same rank of it, over torchft's HTTP transport: the agreed weights, the outer
  momentum, the weights themselves and the step count) and sends no change of its own that round;
  from then on it trains like the others. Its inner optimizer starts afresh;
- a sync that a group fails in the middle of is dropped by every group (torchft's ``should_commit``):
  they continue from the weights they agreed on before it.

torchft's int8 kernels need Triton on a GPU; Tessera compresses itself (:mod:`tessera.across.compress`)
and only moves bytes through torchft's process group. Each quorum may rebuild that process group, so
no transfer may be in flight at a quorum: Streaming DiLoCo's ``delay`` is below the steps between two
fragments' syncs, so a fragment lands (and its sync is committed or dropped) before the next one's quorum.

Example (one group's job; ``TORCHFT_LIGHTHOUSE`` names the Lighthouse)::

    across = TorchftAcross(group=0, lighthouse="http://10.0.0.1:29510")
    outer = OuterSync(dict(model.named_parameters()), across, spec, weights=[0.5, 0.5], index=0)
    across.attach(outer)
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessera import log, traffic
from tessera.across.heal import heal_state, load_heal_state, load_slot_heal_state, slot_heal_state
from tessera.across.lighthouse import GROUP_ENV, LIGHTHOUSE_ENV, check_reachable
from tessera.across.meet import Across
from tessera.across.outer import OuterSync
from tessera.distributed import store_address
from tessera.errors import PlanError

TIMEOUT_ENV = "TESSERA_FT_TIMEOUT_S"
MAX_DROPPED_SYNCS = 5  # in a row


def group_from_env(count: int) -> int:
    """This job's group under fault-tolerant Plan.groups, from TESSERA_GROUP (refused when unset or out of range)."""
    text = os.environ.get(GROUP_ENV, "")
    if not text.isdigit() or not 0 <= int(text) < count:
        raise PlanError(
            f"Plan.groups.fault_tolerant=true runs each of the {count} groups as its own job, and this one does not "
            f"say which it is: {GROUP_ENV}={text!r} must be 0 to {count - 1} (`tessera train` sets it; on several "
            f"machines launch each group with `tessera train CONFIG --group G --lighthouse ADDRESS`)."
        )
    return int(text)


class _Done:
    """A transfer that already finished (torchft's errors are reported to its Manager, not raised)."""

    def wait(self) -> bool:
        return True


class _Pending:
    """A transfer in flight while the next inner steps compute (Streaming DiLoCo's delay): ``finish`` waits
    for it, once, when the fragment lands; its errors go to the Manager, which drops the sync at commit."""

    def __init__(self, finish: Callable[[], Any], span: Any) -> None:
        self.finish, self.span = finish, span

    def wait(self) -> bool:
        if self.finish is not None:
            self.finish()
            self.finish = None
            traffic.finish(self.span)
        return True


class TorchftAcross(Across):
    """The groups meet through torchft: a quorum at each outer sync, sums over the groups in it.

    ``group``: this group's index in Plan.groups; ``lighthouse``: the Lighthouse's address;
    ``timeout_s``: how long a collective or a recovery may take before the group counts as failed.
    Every rank of the group makes one. ``slots``: how many of the group's ranks meet the other groups
    (the smallest group's size, when groups differ; rank 0's Manager serves the group to the
    Lighthouse); the ranks past them take each decision and a healed state from rank 0 over ``inside``,
    the group's own ranks."""

    def __init__(
        self,
        group: int,
        lighthouse: str,
        timeout_s: float = 60.0,
        device: str = "cpu",
        slots: int | None = None,
        inside: dist.ProcessGroup | None = None,
    ) -> None:
        check_reachable(lighthouse)
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.inside = inside
        size = dist.get_world_size(inside) if inside is not None else 1
        self.rank = dist.get_rank(inside) if inside is not None else 0
        self.slots = slots or size
        self.extra = size > self.slots  # ranks past the slots wait for rank 0's word
        self.outer: OuterSync | None = None
        self.healed = False
        # Groups that differ heal in canonical slots: the state this rank serves (cut before each quorum, when
        # every rank of the group can take part) and the one it took (turned into pieces after the quorum).
        self.served: dict[str, Any] | None = None
        self.taken: dict[str, Any] | None = None
        self.syncs: list[dict[str, Any]] = []  # per sync: groups taking part, healed, committed (for logs)
        self.manager: Any = None
        if self.rank >= self.slots:
            return
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = ProcessGroupNCCL(timeout=timeout) if device == "cuda" else ProcessGroupGloo(timeout=timeout)
        store_addr, store_port = store_address()  # (a plain process's one-rank group has no MASTER_* variables)
        self.manager = Manager(
            pg=self.pg,
            store_addr=store_addr,
            store_port=store_port,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the sync, so a group coming back takes part at once
            init_sync=False,  # every group builds the same weights from the same seed
            lighthouse_addr=lighthouse,
            replica_id=f"group_{group}",
            rank=self.rank,
            world_size=self.slots,
            timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=max(timeout_s, 3600.0)),  # groups wait H steps for each other
            connect_timeout=timeout,
            max_retries=MAX_DROPPED_SYNCS,  # then it raises: syncs that keep failing are a broken job
        )

    @classmethod
    def from_env(
        cls, group: int, device: str = "cpu", slots: int | None = None, inside: dist.ProcessGroup | None = None
    ) -> TorchftAcross:
        """For group ``group`` of a job ``tessera train`` launched: the Lighthouse from TORCHFT_LIGHTHOUSE."""
        lighthouse = os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise PlanError(
                f"Plan.groups.fault_tolerant=true needs a Lighthouse: {LIGHTHOUSE_ENV} is not set (`tessera train` "
                "starts one and sets it; on several machines start `tessera lighthouse` and pass --lighthouse)."
            )
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "60"))
        return cls(group, lighthouse, timeout_s=timeout_s, device=device, slots=slots, inside=inside)

    def attach(self, outer: OuterSync) -> None:
        """Serve ``outer``'s state to groups coming back, and load a live group's when this one does."""
        self.outer = outer
        if self.manager is None:
            return

        def load(state: dict[str, Any]) -> None:
            if outer.canonical:
                self.taken = state  # made pieces in begin(), by every rank of the group
            else:
                load_heal_state(outer, state)
            self.healed = True

        def serve() -> dict[str, Any]:  # torchft sends it to the group coming back: counted as sent across
            state = self.served if outer.canonical else heal_state(outer)
            traffic.finish(traffic.count_across_groups("whole", traffic.tensor_bytes(state), 2))
            return state

        self.manager.register_state_dict_fn("outer", load, serve)

    def _from_rank0(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank of the group (as it is when no rank is past the slots)."""
        if not self.extra:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.inside, 0), group=self.inside)
        return box[0]

    def begin(self) -> bool:
        self.healed, self.taken = False, None
        groups = 0
        if self.outer is not None and self.outer.canonical:
            self.served = slot_heal_state(self.outer)  # every rank of the group: a sharded one gathers
        if self.manager is not None:
            if self.outer is not None:
                # torchft heals the groups whose step is behind the quorum's highest. Its own count starts at 0
                # in every new Manager; the inner step is in every checkpoint and alike in groups that are in
                # step, so a group resumed from an older checkpoint than the others' heals from them.
                committed = self.manager.batches_committed()
                self.manager.load_state_dict({"step": self.outer.step, "batches_committed": committed})
            self.manager.start_quorum()
            groups = self.manager.num_participants()
        healed, groups = self._from_rank0((self.healed, groups))
        if healed and self.outer is not None and self.outer.canonical:  # every rank: its pieces from the slots
            taken = self.taken
            shape = None if taken is None else {
                "step": taken["step"], "due": taken["due"], "momentum": ["momentum" in f for f in taken["fragments"]]
            }  # fmt: skip
            load_slot_heal_state(self.outer, taken, self._from_rank0(shape))
        elif healed and self.extra:  # the ranks past the slots take the state rank 0 just took
            assert self.outer is not None
            state = self._from_rank0(heal_state(self.outer) if self.rank == 0 else None)
            if self.manager is None:
                load_heal_state(self.outer, state)
        self.healed = healed
        self.syncs.append({"groups": groups, "healed": healed})
        return not healed

    def size(self) -> int:
        return self.pg.size()

    # Both start their transfer and count it when it is waited for (when the fragment lands: at once, or
    # ``delay`` steps later): torch does not register torchft's process group, so tessera.traffic's
    # dispatcher kernel cannot place it.
    def all_reduce(self, tensor: torch.Tensor) -> Any:
        from torch.distributed import ReduceOp

        span = traffic.count_across_groups("all_reduce", tensor.numel() * tensor.element_size(), self.size())
        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)  # errors go to the Manager
        return _Pending(work.wait, span)

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        from torch.distributed.distributed_c10d import AllgatherOptions

        span = traffic.count_across_groups("all_gather", tensor.numel() * tensor.element_size(), self.size())
        started: list[Any] = []
        options = AllgatherOptions()
        self._guarded(lambda: started.append(self.pg.allgather_into_tensor_coalesced([out], [tensor], options)))
        return _Pending(lambda: started and self._guarded(started[0].wait), span)

    def total_weight(self, weight: float) -> float:
        total = torch.tensor([weight], dtype=torch.float64)
        if self.manager is not None:
            self.all_reduce(total).wait()
        return self._from_rank0(float(total))

    def commit(self) -> bool:
        committed = self._from_rank0(self.manager.should_commit() if self.manager is not None else None)
        self.syncs[-1]["committed"] = committed
        if not committed and self.rank == 0:  # dropped by every group; said (once a group), so it is seen
            error = self.manager.errored()
            cause = getattr(error, "original_exception", error)
            log.get("across").warning(
                f"outer sync dropped by the groups ({type(cause).__name__}: {cause})"
                if cause is not None
                else "outer sync dropped by the groups (another group failed during it)"
            )
        return committed

    def _guarded(self, run: Callable[[], Any]) -> None:
        """Run a collective; a failure (a group gone mid-transfer) is the Manager's to report at commit."""
        if self.manager.errored():
            return
        try:
            run()
        except Exception as exc:
            self.manager.report_error(exc)

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
