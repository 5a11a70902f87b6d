"""Every byte of every collective, counted per link class: inside a node, between nodes, across
``Plan.groups``.

The count happens in torch's dispatcher. Every collective goes through one of its ``c10d`` ops
(DDP's buckets from C++, FSDP2's gathers and reduce-scatters, Tessera's own all-reduces,
pipeline sends, checkpoint metadata) or ``_c10d_functional`` ops (DTensor's tensor parallel).
:func:`install` registers one Python kernel for those ops just below autograd. It counts the
collective, then hands it to torch's own kernel below. No other op passes through Python.
Collectives issued under ``torch.inference_mode`` skip that key and go uncounted.

**Bytes** are what one rank sends under a bandwidth-optimal (ring or pipelined tree) algorithm,
as nccl-tests' bus bandwidth counts them; over the ranks they add up to what such an algorithm
moves:
- an all-reduce of S bytes over n ranks sends 2(n − 1)/n · S;
- an all-gather, reduce-scatter or all-to-all of S bytes in all sends (n − 1)/n · S;
- a broadcast or a reduce of S bytes sends (n − 1)/n · S on average (its root sends more);
- a send of S bytes sends S.

gloo has no reduce-scatter of its own (it all-reduces, then keeps a slice), so there a reduce-scatter
counts as the all-reduce it is. The testbed's kernel counters check these figures
(``tests/test_testbed.py``).

A collective's **time** runs from its issue to its completion (its Work's future; a functional
collective ends at its ``wait_tensor``). A link class's achieved bandwidth is the bytes of its timed
collectives over the time during which at least one of them was in flight. Timing is off unless
:func:`timing` turns it on, as it costs a callback per collective (first measured as ~20 % on
collective-heavy CPU tests, then not reproduced: docs/architecture.md); the trainer times only the
steps it reports.

Example:
    >>> traffic.install(); traffic.bind(nodes=["a", "a", "b", "b"], groups=[0, 0, 1, 1])
    >>> traffic.timing(True)                 # also time them (costs a callback per collective)
    >>> ...  # train
    >>> traffic.take()["inter_node"].bytes   # sent by this rank since the last take()
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

LINKS = ("intra_node", "inter_node", "across_groups")


@dataclass
class LinkTraffic:
    """What one rank sent over one link class: bytes and collectives (all of them), and the bytes of
    the timed ones (:func:`timing`) with the seconds during which one of those was in flight."""

    bytes: float = 0.0
    collectives: int = 0
    busy_s: float = 0.0
    timed_bytes: float = 0.0

    @property
    def gbit_s(self) -> float | None:
        """Achieved bandwidth of the timed collectives while busy (None when nothing was timed)."""
        return self.timed_bytes * 8 / self.busy_s / 1e9 if self.busy_s > 0 else None

    def __add__(self, other: LinkTraffic) -> LinkTraffic:
        return LinkTraffic(
            self.bytes + other.bytes,
            self.collectives + other.collectives,
            self.busy_s + other.busy_s,
            self.timed_bytes + other.timed_bytes,
        )


def job_traffic(per_rank: Sequence[dict[str, LinkTraffic]]) -> dict[str, LinkTraffic]:
    """Every rank's traffic added up per link class (its bandwidth: bytes over every rank's busy time)."""
    return {link: sum((rank[link] for rank in per_rank), LinkTraffic()) for link in LINKS}


# What one rank sends per byte it contributes, by kind of collective, over n ranks.
_PER_BYTE: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,  # the input is this rank's shard
    "reduce_scatter": lambda n: (n - 1) / n,  # the input is the whole tensor
    "spread": lambda n: (n - 1) / n,  # all-to-all; broadcast, reduce, gather, scatter on average
    "whole": lambda n: 1.0,
}
# gloo has no reduce-scatter of its own: it all-reduces the whole tensor and keeps a slice
# (ProcessGroupGloo; the cost model's Link.reduce_scatter_steps says the same).
_ON_GLOO = {"reduce_scatter": "all_reduce"}

# op -> (the argument holding the bytes this rank contributes, kind)
_C10D: dict[str, tuple[int, str]] = {
    "allreduce_": (0, "all_reduce"),
    "allreduce_coalesced_": (0, "all_reduce"),
    "_allgather_base_": (1, "all_gather"),
    "allgather_": (1, "all_gather"),
    "allgather_coalesced_": (1, "all_gather"),
    "allgather_into_tensor_coalesced_": (1, "all_gather"),
    "_reduce_scatter_base_": (1, "reduce_scatter"),
    "reduce_scatter_": (1, "reduce_scatter"),
    "reduce_scatter_tensor_coalesced_": (1, "reduce_scatter"),
    "alltoall_base_": (1, "spread"),
    "alltoall_": (1, "spread"),
    "broadcast_": (0, "spread"),
    "reduce_": (0, "spread"),
    "gather_": (1, "spread"),
    "scatter_": (1, "spread"),
    "send": (0, "whole"),
}
_FUNCTIONAL: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "all_reduce"),
    "all_reduce_": (0, "all_reduce"),
    "all_reduce_coalesced": (0, "all_reduce"),
    "all_reduce_coalesced_": (0, "all_reduce"),
    "all_gather_into_tensor": (0, "all_gather"),
    "all_gather_into_tensor_out": (0, "all_gather"),
    "all_gather_into_tensor_coalesced": (0, "all_gather"),
    "reduce_scatter_tensor": (0, "reduce_scatter"),
    "reduce_scatter_tensor_out": (0, "reduce_scatter"),
    "reduce_scatter_tensor_coalesced": (0, "reduce_scatter"),
    "all_to_all_single": (0, "spread"),
    "broadcast": (0, "spread"),
    "broadcast_": (0, "spread"),
}
# Just below autograd, which has recorded the op by then (funcol's backward is registered there), and
# above every backend: one key for CPU and CUDA alike.
_KEY = "ADInplaceOrView"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or lists, tuples and dicts of them)."""
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class _Counter:
    """This process's totals per link class, and the intervals still to fold into their busy time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nodes: list[str] | None = None  # by global rank
        self.groups: list[int] | None = None
        self.links: dict[tuple[int, ...], str] = {}
        self.timing = False
        self.totals = {link: LinkTraffic() for link in LINKS}
        self.spans: dict[str, list[list[float]]] = {link: [] for link in LINKS}  # [start, end (0: in flight), bytes]
        self.waiting: dict[int, list[float]] = {}  # a functional collective's output -> its span

    def link(self, ranks: Sequence[int]) -> str | None:
        """The link class joining global ``ranks`` (None before :func:`bind`)."""
        if self.nodes is None or self.groups is None:
            return None
        key = tuple(ranks)
        if key not in self.links:
            if len({self.groups[r] for r in key}) > 1:
                self.links[key] = "across_groups"
            else:
                self.links[key] = "inter_node" if len({self.nodes[r] for r in key}) > 1 else "intra_node"
        return self.links[key]

    def add(self, link: str, nbytes: float) -> list[float] | None:
        """Count a collective; when timing, return its span for the caller to close."""
        span = [time.perf_counter(), 0.0, nbytes] if self.timing else None
        with self.lock:
            total = self.totals[link]
            total.bytes += nbytes
            total.collectives += 1
            if span is not None:
                self.spans[link].append(span)
        return span

    def take(self) -> dict[str, LinkTraffic]:
        """The totals since the last take, with the busy time of the collectives that finished."""
        with self.lock:
            out = {}
            for link in LINKS:
                done = [s for s in self.spans[link] if s[1]]
                self.spans[link] = [s for s in self.spans[link] if not s[1]]
                total = self.totals[link]
                timed = sum(s[2] for s in done)  # a collective still in flight is timed at a later take
                out[link] = LinkTraffic(total.bytes, total.collectives, _union_length(done), timed)
                self.totals[link] = LinkTraffic()
            self.waiting = {key: span for key, span in self.waiting.items() if not span[1]}
            return out


def _union_length(spans: list[list[float]]) -> float:
    """Seconds covered by at least one of ``spans``."""
    covered, reach = 0.0, float("-inf")
    for start, end, *_ in sorted(spans):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


_COUNTER = _Counter()
# process group -> its global ranks and backend (weak: a destroyed group is not kept alive)
_GROUPS: weakref.WeakKeyDictionary[Any, tuple[list[int], str]] = weakref.WeakKeyDictionary()
_LIBRARIES: list[torch.library.Library] = []


def _finish(span: list[float]) -> Callable[[Any], None]:
    """A Work-future callback that closes ``span``."""
    return lambda _: finish(span)


def _count(group: Any, kind: str, nbytes: int, peer: int | None = None) -> list[float] | None:
    """Count a collective of ``kind`` over ``group`` (a boxed process group or a group name) to which this
    rank gives ``nbytes``; ``peer``: a send's destination in the group. Returns its time span, or None
    when it is not timed or crosses no link (one rank, or before :func:`bind`)."""
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    elif isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    if group not in _GROUPS:
        try:
            _GROUPS[group] = (dist.get_process_group_ranks(group), dist.get_backend(group))
        except (KeyError, ValueError, RuntimeError):  # a group torch does not know (torchft's own): its
            _GROUPS[group] = ([], "")  # owner counts it (count_across_groups); counting never fails a collective
    ranks, backend = _GROUPS[group]
    if peer is not None:
        ranks = [dist.get_rank(), ranks[peer]]
    link = _COUNTER.link(ranks) if len(ranks) > 1 else None
    if link is None:
        return None
    if backend == "gloo":
        kind = _ON_GLOO.get(kind, kind)
    return _COUNTER.add(link, nbytes * _PER_BYTE[kind](len(ranks)))


def _traced(value: Any) -> bool:
    """Whether ``value`` holds the stand-in tensors of torch.compile tracing a graph (compiled blocks under tp):
    that collective is recorded, not sent; the compiled graph's call of it is counted when it runs."""
    return any(is_fake(t) for t in _tensors(value))


def _c10d_kernel(name: str, arg: int, kind: str) -> Callable[..., Any]:
    op = getattr(torch.ops.c10d, name).default
    group_at = next(i for i, a in enumerate(op._schema.arguments) if a.name == "process_group")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            result = op(*args, **kwargs)
        if _traced(args[arg]):
            return result
        span = _count(args[group_at], kind, tensor_bytes(args[arg]), peer=args[2] if name == "send" else None)
        if span is not None:
            work = result[-1] if isinstance(result, tuple) else result
            try:
                dist.Work.unbox(work).get_future().add_done_callback(_finish(span))
            except RuntimeError:  # a backend without futures for this op (gloo's send): counted, not timed
                span[1] = span[0]
        return result

    return kernel


def _functional_kernel(name: str, arg: int, kind: str) -> Callable[..., Any]:
    op = getattr(torch.ops._c10d_functional, name).default
    group_at = next(i for i, a in enumerate(op._schema.arguments) if a.name == "group_name")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            result = op(*args, **kwargs)
        if _traced(args[arg]):
            return result
        span = _count(args[group_at] if len(args) > group_at else kwargs["group_name"], kind, tensor_bytes(args[arg]))
        if span is not None:
            for out in _tensors(result):  # it ends when its output is waited for
                _COUNTER.waiting[id(out)] = span
        return result

    return kernel


def _wait_kernel() -> Callable[..., Any]:
    op = torch.ops._c10d_functional.wait_tensor.default

    def kernel(tensor: torch.Tensor) -> Any:
        with torch._C._AutoDispatchBelowADInplaceOrView():
            result = op(tensor)
        finish(_COUNTER.waiting.pop(id(tensor), None))
        return result

    return kernel


def install() -> None:
    """Count every collective of this process from now on (once; later calls do nothing)."""
    if _LIBRARIES:
        return
    for namespace, ops, make in (("c10d", _C10D, _c10d_kernel), ("_c10d_functional", _FUNCTIONAL, _functional_kernel)):
        library = torch.library.Library(namespace, "IMPL")
        for name, (arg, kind) in ops.items():
            if hasattr(getattr(torch.ops, namespace), name):  # an older torch may lack a variant
                library.impl(name, make(name, arg, kind), _KEY)
        _LIBRARIES.append(library)
    _LIBRARIES[-1].impl("wait_tensor", _wait_kernel(), _KEY)


def bind_job(node: str, group: int) -> None:
    """Tell every rank this rank's node and group of Plan.groups (a collective: every rank calls it)."""
    places: list[tuple[str, int]] = [("", 0)] * dist.get_world_size()
    dist.all_gather_object(places, (node, group))
    bind([n for n, _ in places], [g for _, g in places])


def bind(nodes: Sequence[str], groups: Sequence[int]) -> None:
    """Say which node and which of Plan.groups each global rank is on (the link classes follow)."""
    with _COUNTER.lock:
        _COUNTER.nodes, _COUNTER.groups, _COUNTER.links = list(nodes), list(groups), {}


def count_across_groups(kind: str, nbytes: int, groups: int) -> list[float] | None:
    """Count a collective across Plan.groups over a process group torch does not register (torchft's,
    rebuilt at each quorum: the dispatcher kernel cannot tell its ranks, so it leaves it to its owner):
    ``kind`` as in :data:`_PER_BYTE`, ``nbytes`` this rank's part, over ``groups`` groups. Returns its span
    to close with :func:`finish` when timing, else None."""
    if groups < 2:
        return None
    return _COUNTER.add("across_groups", nbytes * _PER_BYTE[kind](groups))


def finish(span: list[float] | None) -> None:
    """Close a timed collective's span (as :func:`count_across_groups` returns it) once it has finished."""
    if span is not None:
        span[1] = time.perf_counter()


def timing(on: bool) -> None:
    """Time the collectives issued from now on (``on``) or not; their bytes are counted either way."""
    _COUNTER.timing = on


def take() -> dict[str, LinkTraffic]:
    """What this rank sent per link class since the last call (or since :func:`bind`)."""
    return _COUNTER.take()
