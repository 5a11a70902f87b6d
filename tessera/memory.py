"""Exact accounting of model-state bytes on this rank (tensors, not process RSS), and of the bytes
autograd saves for backward (:class:`SavedBytes`: the profiler and the emulator count activations with it).

Example:
    >>> n = model_state_bytes(model, optimizer)
    >>> n.params, n.grads, n.optimizer, int(n)     # int(n) is the total
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tessera.distributed import local


class StateBytes(int):
    """Total bytes (an int) that also carries the parts: ``params``, ``grads``, ``optimizer``."""

    params: int
    grads: int
    optimizer: int

    def __new__(cls, params: int, grads: int, optimizer: int) -> StateBytes:
        obj = super().__new__(cls, params + grads + optimizer)
        obj.params, obj.grads, obj.optimizer = params, grads, optimizer
        return obj

    def __repr__(self) -> str:
        return f"StateBytes(params={self.params}, grads={self.grads}, optimizer={self.optimizer})"


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield local(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _plain(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors that hold ``t``'s data: ``t`` itself, or the inner tensors of a wrapper subclass
    (torchao's float8 weights under FSDP2), which has no storage of its own."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not hasattr(t, "__tensor_flatten__"):
        yield t
        return
    for name in t.__tensor_flatten__()[0]:
        yield from _plain(getattr(t, name))


def _bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once across calls."""
    total = 0
    for t in (plain for tensor in tensors for plain in _plain(tensor)):
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _optimizer_state(optimizer: Any) -> Any:
    # Unwrap BoostedOptimizer / ShardedOptimizer to the optimizer that owns the state.
    while hasattr(optimizer, "inner") or hasattr(optimizer, "local"):
        optimizer = getattr(optimizer, "inner", None) or optimizer.local
    return optimizer.state


def ddp_bucket_bytes(model: nn.Module) -> int:
    """Bytes of the gradient buckets DDP's C++ reducer holds for ``model``'s DDP modules. They stay
    allocated between steps, when ``zero_grad(set_to_none=True)`` has dropped every Python reference
    to them, so neither the parameters' ``.grad`` nor a step's allocations show them."""
    from torch.nn.parallel import DistributedDataParallel

    total = 0
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            sizes = str(module._get_ddp_logging_data().get("bucket_sizes", ""))
            total += sum(int(size) for size in sizes.split(",") if size.strip())
    return total


def model_state_bytes(model: nn.Module, optimizer: Any | None = None) -> StateBytes:
    """This rank's bytes of parameters, gradients and optimizer state.

    Sharded tensors count only their local shard; tensors sharing storage (views,
    tied weights, DDP gradient buckets) count once. Under DDP the gradients are its buckets,
    held whether or not ``.grad`` points at them (:func:`ddp_bucket_bytes`).
    """
    seen: set[tuple[str, int]] = set()
    params = list(model.parameters())
    p_bytes = _bytes((local(p) for p in params), seen)
    g_bytes = _bytes((local(p.grad) for p in params if p.grad is not None), seen)
    g_bytes = max(g_bytes, ddp_bucket_bytes(model))
    o_bytes = _bytes(_tensors(dict(_optimizer_state(optimizer))), seen) if optimizer is not None else 0
    return StateBytes(p_bytes, g_bytes, o_bytes)


class SavedBytes:
    """Live and peak bytes saved for backward while the context is open.

    Example:
        >>> counter = SavedBytes()
        >>> with counter.track():
        ...     loss = model(x).sum()
        >>> counter.peak
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.live = 0
        self.peak = 0
        # Parameters and buffers that autograd saves (a matmul keeps its weight) cost no extra memory.
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._held: dict[tuple[str, int], list[int]] = {}  # storage -> [saved tensors holding it, its bytes]

    @contextmanager
    def track(self) -> Iterator[SavedBytes]:
        counter = self

        class Held:
            def __init__(self, t: torch.Tensor) -> None:
                # FSDP's gathered weights are parameters too (module parameters while a block runs), and
                # are freed after it whatever autograd holds: not activations either.
                shared = (
                    isinstance(t, torch.nn.Parameter)
                    or isinstance(t._base, torch.nn.Parameter)  # e.g. the transposed weight a matmul keeps
                    or t.untyped_storage().data_ptr() in counter._exclude
                )
                # Count each storage once, whole, while any saved tensor holds it: several ops save views
                # of one tensor (counting each view overstated a block's activations by a quarter).
                storage = t.untyped_storage()
                self.t, self.key = t, None if shared else (str(t.device), storage.data_ptr())
                if self.key is not None:
                    held = counter._held.setdefault(self.key, [0, storage.nbytes()])
                    held[0] += 1
                    if held[0] == 1:
                        counter.live += held[1]
                        counter.peak = max(counter.peak, counter.live)

            def __del__(self) -> None:
                if self.key is not None and (held := counter._held.get(self.key)) is not None:
                    held[0] -= 1
                    if held[0] == 0:
                        counter.live -= held[1]
                        del counter._held[self.key]

        with torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.t):
            yield self


@contextmanager
def peak_tensor_bytes(device: torch.device, live_before: int) -> Iterator[list[int]]:
    """Measure the peak bytes of tensors on ``device`` while the block runs; the list it yields
    holds one number when the block ends.

    An accelerator reports its allocator's peak directly. On CPU there is no allocator counter, so
    the block runs under the profiler with ``profile_memory``: every allocation and free in order,
    whose running sum peaks at the block's transient high-water mark; ``live_before`` (the tensor
    bytes held when it starts, e.g. :func:`model_state_bytes`) is added to it. Costly on CPU:
    measure one step, not every step.

    Example:
        >>> with peak_tensor_bytes(torch.device("cpu"), int(model_state_bytes(model, opt))) as peak:
        ...     train_one_step()
        >>> peak[0]
    """
    result: list[int] = []
    if device.type != "cpu" and hasattr(torch, device.type):
        backend = getattr(torch, device.type)
        backend.synchronize(device)
        backend.memory.reset_peak_memory_stats(device)
        yield result
        backend.synchronize(device)
        result.append(int(backend.memory.max_memory_allocated(device)))
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    changes = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    result.append(live_before + peak)


def release_free_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``); False where there is none.

    A training step allocates and frees many differently sized buffers, and glibc keeps the freed
    ones: on a lone rank resident memory crept up ~20 MiB over 2,000 steps while the heap in use
    stayed nearly flat, and trimming every 200 steps held it flat (docs/benchmarks.md, soak). It
    takes about 0.4 ms.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        return False
