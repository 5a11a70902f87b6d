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

torchft's int8 kernels need Triton on a GPU; Tessera compresses itself (:mod:`tessera.parallel.compress`)
and only moves bytes through torchft's process group. Each quorum may rebuild that process group,
so a transfer cannot stay in flight across a sync here: ``delay`` must be 0.

Example (one group's job; ``TORCHFT_LIGHTHOUSE`` names the Lighthouse)::

    across = TorchftAcross(group=0, lighthouse="http://10.0.0.1:29510")
    outer = OuterSync(dict(model.named_parameters()), across, spec, weights=[0.5, 0.5], index=0)
    across.attach(outer)
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import urllib.parse
from collections.abc import Callable
from typing import Any

import torch

from tessera import traffic
from tessera.errors import PlanError
from tessera.parallel.outer import Across, OuterSync

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
GROUP_ENV = "TESSERA_GROUP"  # which of Plan.groups this job is (tessera train sets it)
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


def check_reachable(lighthouse: str, timeout_s: float = 5.0) -> None:
    """Refuse a Lighthouse address that nothing answers on, before torchft would wait on it."""
    parsed = urllib.parse.urlparse(lighthouse if "://" in lighthouse else f"http://{lighthouse}")
    if not parsed.hostname or not parsed.port:
        raise PlanError(
            f"the Lighthouse address {lighthouse!r} needs a host and a port, e.g. http://10.0.0.1:29510 "
            "(`tessera lighthouse` prints its own)."
        )
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise PlanError(
            f"the Lighthouse at {lighthouse} cannot be reached ({exc.strerror or exc}): start it first "
            f"(`tessera lighthouse --bind {parsed.hostname}:{parsed.port}`) or give its address in {LIGHTHOUSE_ENV}."
        ) from None


def start_lighthouse(
    bind: str = "127.0.0.1:0", min_groups: int = 1, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 5000
) -> Any:
    """A torchft Lighthouse listening on ``bind`` (``host:port``; port 0: any free one). Its
    ``address()`` is what every group's Manager dials; ``shutdown()`` stops it.

    ``min_groups``: the fewest groups a quorum may have; ``heartbeat_timeout_ms``: how long a silent
    group counts as alive (then the others carry on without it)."""
    from torchft._torchft import LighthouseServer

    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit():
        raise PlanError(f"the Lighthouse's bind address {bind!r} must be host:port, e.g. 127.0.0.1:29510.")
    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_groups,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as exc:  # torchft's Rust server: a port in use, an address not on this machine
        raise PlanError(f"the Lighthouse cannot listen on {bind} ({exc}): give a free port of this machine.") from None
    return server


def lighthouse_address(server: Any, bind: str) -> str:
    """The address groups dial: the bound host (torchft advertises the machine's name) and its port."""
    port = urllib.parse.urlparse(server.address()).port
    return f"http://{bind.rpartition(':')[0]}:{port}"


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class TorchftAcross(Across):
    """The groups meet through torchft: a quorum at each outer sync, sums over the groups in it.

    ``group``: this group's index in Plan.groups; ``lighthouse``: the Lighthouse's address;
    ``timeout_s``: how long a collective or a recovery may take before the group counts as failed.
    Every rank of the group makes one (rank 0's Manager serves the group to the Lighthouse)."""

    def __init__(self, group: int, lighthouse: str, timeout_s: float = 60.0, device: str = "cpu") -> None:
        check_reachable(lighthouse)
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = ProcessGroupNCCL(timeout=timeout) if device == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the sync, so a group coming back takes part at once
            init_sync=False,  # every group builds the same weights from the same seed
            lighthouse_addr=lighthouse,
            replica_id=f"group_{group}",
            timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=max(timeout_s, 3600.0)),  # groups wait H steps for each other
            connect_timeout=timeout,
            max_retries=MAX_DROPPED_SYNCS,  # then it raises: syncs that keep failing are a broken job
        )
        self.healed = False
        self.syncs: list[dict[str, Any]] = []  # per sync: groups taking part, healed, committed (for logs)

    @classmethod
    def from_env(cls, group: int, device: str = "cpu") -> TorchftAcross:
        """For group ``group`` of a job ``tessera train`` launched: the Lighthouse from TORCHFT_LIGHTHOUSE."""
        lighthouse = os.environ.get(LIGHTHOUSE_ENV, "")
        if not lighthouse:
            raise PlanError(
                f"Plan.groups.fault_tolerant=true needs a Lighthouse: {LIGHTHOUSE_ENV} is not set (`tessera train` "
                "starts one and sets it; on several machines start `tessera lighthouse` and pass --lighthouse)."
            )
        return cls(group, lighthouse, timeout_s=float(os.environ.get(TIMEOUT_ENV, "60")), device=device)

    def attach(self, outer: OuterSync) -> None:
        """Serve ``outer``'s state to groups coming back, and load a live group's when this one does."""

        def load(state: dict[str, Any]) -> None:
            outer.load_heal_state(state)
            self.healed = True

        def serve() -> dict[str, Any]:  # torchft sends it to the group coming back: counted as sent across
            state = outer.heal_state()
            traffic.finish(traffic.count_across_groups("whole", _tensor_bytes(state), 2))
            return state

        self.manager.register_state_dict_fn("outer", load, serve)

    def begin(self) -> bool:
        self.healed = False
        self.manager.start_quorum()
        self.syncs.append({"groups": self.manager.num_participants(), "healed": self.healed})
        return not self.healed

    def size(self) -> int:
        return self.pg.size()

    # Both wait for their transfer (delay is 0: the sync lands at once) and count it: torch does not
    # register torchft's process group, so tessera.traffic's dispatcher kernel cannot place it.
    def all_reduce(self, tensor: torch.Tensor) -> Any:
        from torch.distributed import ReduceOp

        span = traffic.count_across_groups("all_reduce", tensor.numel() * tensor.element_size(), self.size())
        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()  # errors go to the Manager
        traffic.finish(span)
        return _Done()

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> Any:
        from torch.distributed import AllgatherOptions

        span = traffic.count_across_groups("all_gather", tensor.numel() * tensor.element_size(), self.size())
        self._guarded(lambda: self.pg.allgather_into_tensor_coalesced([out], [tensor], AllgatherOptions()).wait())
        traffic.finish(span)
        return _Done()

    def total_weight(self, weight: float) -> float:
        total = torch.tensor([weight], dtype=torch.float64)
        self.all_reduce(total).wait()
        return float(total)

    def commit(self) -> bool:
        committed = self.manager.should_commit()
        self.syncs[-1]["committed"] = committed
        if not committed:  # dropped by every group; said, so that a sync that never succeeds is seen
            error = self.manager.errored()
            cause = getattr(error, "original_exception", error)
            print(
                f"tessera: warning: outer sync dropped by the groups ({type(cause).__name__}: {cause})"
                if cause is not None
                else "tessera: warning: outer sync dropped by the groups (another group failed during it)",
                file=sys.stderr,
                flush=True,
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
        self.manager.shutdown(wait=False)
