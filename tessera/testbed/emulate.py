"""Emulation: local CPU ranks play the devices of a cluster file, so heterogeneous plans run here.

Rank ``r`` plays the cluster's ``r``-th device (file order, the launch order; ``Plan.placement``
moves it). Every transformer block it runs sleeps after its forward and its backward so that the
block takes ``slowdown`` times its CPU time (thread CPU time: waiting for a shared core is not
compute), ``slowdown`` being the fastest device's peak over this device's: a quarter-speed
device's blocks take four times as long. Sleeping, not spinning, is what keeps
two ranks on one core honest (a busy loop would steal the other rank's time).

Links are slowed by waiting, on top of the real local transfer, as long as the cluster's link
would take: DDP's gradient all-reduces and the gradient averaging after a pipeline over the
slowest link of the rank's data-parallel group (:meth:`Emulator.slow_links`,
:meth:`Emulator.delay_all_reduce`), FSDP's per-block gathers and reduce-scatters likewise
(:meth:`Emulator.slow_sharding`), and a pipeline stage's inputs and output gradients over the
link to the neighbouring stage's device (:meth:`Emulator.slow_transfers`). Not slowed: tied
embeddings' small all-reduce, ZeRO-1's parameter all-gather, offload's host copies.

The memory accountant checks, after every backward, that this rank's exact model-state bytes
(parameters, gradients, optimizer state: :func:`tessera.memory.model_state_bytes`) plus the
peak bytes saved for backward since the last check fit in the device's usable memory, and
raises :class:`EmulatedOutOfMemory` naming the device if not.

Everything that ran under emulation says so: :meth:`Emulator.describe` is logged by the trainer
and written into benchmark output.

Example:
    >>> booster = tessera.Booster(plan, hooks=EmulationHooks("cluster.yaml"))
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.cluster.spec import USABLE_MEMORY, Cluster, ClusterError
from tessera.errors import NotSupportedYet
from tessera.memory import SavedBytes, model_state_bytes
from tessera.plan import Plan
from tessera.runtime.hooks import Hooks


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):  # e.g. a Hugging Face ModelOutput
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def _reduces_gradients(module: nn.Module) -> bool:
    """Whether FSDP will reduce-scatter ``module``'s gradients in this backward (False inside
    ``no_sync``: ``set_requires_gradient_sync(False)``); True for a module FSDP does not manage."""
    state = getattr(module, "_get_fsdp_state", None)
    groups = getattr(state(), "_fsdp_param_groups", ()) if state is not None else ()
    return all(getattr(g, "reduce_grads", True) for g in groups)


class EmulatedOutOfMemory(RuntimeError):
    """An emulated device would have run out of memory."""


def _pace_peak(device: Any, dtype: str) -> float:
    """The peak an emulated device is paced by: its peak for ``dtype``, else for fp32 (0: neither)."""
    return device.peak(dtype) or device.peak("fp32") or 0.0


def check_playable(cluster: Cluster, devices: Iterable[int], dtype: str, source: str = "the cluster file") -> None:
    """Refuse (ClusterError, a bad input) a cluster whose ``devices`` the ranks cannot play: one beyond the
    devices it describes, or one whose type has no peak for ``dtype`` or fp32 to pace it by."""
    described, devices = cluster.devices(), set(devices)
    beyond = sorted(d for d in devices if d >= len(described))
    if beyond:
        raise ClusterError(
            f"{source} describes {len(described)} devices, but the launch's ranks play device {beyond[-1]} too: "
            f"each rank plays one device; launch {len(described)} ranks (--nproc x --nnodes) or describe "
            f"{beyond[-1] + 1} devices."
        )
    for _, _, device in (described[d] for d in sorted(devices)):
        if not _pace_peak(device, dtype):
            needed = " or ".join(dict.fromkeys([dtype, "fp32"]))
            raise ClusterError(
                f"{source}: device type {device.name!r} gives no peak for {needed}, which emulation paces it by: add "
                f"device_types.{device.name}.peak_tflops.{dtype}."
            )


class Emulator:
    """This rank as one device of ``cluster``: slower by sleeping, and held to its memory."""

    def __init__(
        self,
        cluster: Cluster | str | Path,
        rank: int,
        dtype: str = "fp32",
        time_scale: float = 1.0,
        block_s: tuple[float, float, float] | None = None,
    ) -> None:
        """``block_s`` = (seconds per call, seconds per sample, backward/forward ratio) of one block's
        forward on the fastest device: blocks then take that line scaled by speed, whatever this
        CPU does (it must be faster); without it they take ``slowdown`` × their CPU time."""
        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster.load(cluster)
        check_playable(self.cluster, [rank], dtype)
        devices = self.cluster.devices()
        self.node, self.index, self.device = devices[rank]
        self._device = rank
        peaks = [_pace_peak(t, dtype) for _, _, t in devices]
        own = _pace_peak(self.device, dtype)
        # time_scale > 1 stretches every device, the fastest too: with most of each block asleep, ranks
        # sharing a core barely slow each other, so timings follow the emulated speeds.
        self.slowdown = max(peaks) / own * time_scale
        self.capacity = self.device.memory_gib * 2**30 * USABLE_MEMORY
        self.compute_s = 0.0  # real compute of hooked blocks
        self.slept_s = 0.0
        self.link_s = 0.0  # delays added to gradient all-reduces
        self.block_s = block_s
        self.recompute_full = False  # set by the Booster: backward then includes a second forward
        self.links = True  # False: the cluster's links are this machine's own, left as they are
        self.speed_ratio = max(peaks) / own  # the fastest device's speed over this one's
        self.slowed = {"forward": 0, "backward": 0}  # blocks slowed so far, by pass
        self._batch: dict[int, int] = {}
        self._saved: Any = None  # SavedBytes once track_activations() runs
        self._started: dict[int, float] = {}

    @classmethod
    def from_environment(cls, cluster: Cluster | str | Path, device: int, dtype: str) -> Emulator:
        """An emulator for ``device`` with the pace the environment sets: ``TESSERA_EMULATE_SCALE``,
        ``TESSERA_EMULATE_BLOCK`` ("call,per_sample,ratio" seconds of a block on the fastest device)
        and ``TESSERA_EMULATE_LINKS=0`` (the cluster file's links are this machine's measured ones:
        leave them as they are rather than wait for them again)."""
        scale = float(os.environ.get("TESSERA_EMULATE_SCALE", "1"))
        block = os.environ.get("TESSERA_EMULATE_BLOCK")
        block_s = tuple(float(x) for x in block.split(",")) if block else None
        emulator = cls(cluster, device, dtype, scale, block_s)  # type: ignore[arg-type]
        emulator.links = os.environ.get("TESSERA_EMULATE_LINKS", "1") != "0"
        return emulator

    def describe(self) -> str:
        pace = (
            f"blocks take {self.speed_ratio:.3g}x the given block time"
            if self.block_s is not None
            else f"blocks take {self.slowdown:.3g}x this CPU's compute"
        )
        return f"emulated {self.node}:{self.index} ({self.device.name}: {pace}, {self.device.memory_gib:g} GiB)"

    # ---------------------------------------------------------------- speed
    def slow_down(self, blocks: Iterable[nn.Module]) -> None:
        """Make every block's forward and backward take ``slowdown`` times its real compute."""
        if self.slowdown <= 1.0 and self.block_s is None:
            return
        for block in blocks:
            block.register_forward_pre_hook(self._start_forward)
            block.register_forward_hook(self._stop_hook)
            block.register_full_backward_pre_hook(self._start_backward)
            block.register_full_backward_hook(self._stop_backward)

    def _start(self, module: nn.Module, *args: Any) -> None:
        self._started[id(module)] = (time.perf_counter(), time.thread_time())

    def _start_forward(self, module: nn.Module, args: Any) -> None:
        if args and hasattr(args[0], "shape"):
            self._batch[id(module)] = int(args[0].shape[0])
        self._start(module)

    def _target(self, module: nn.Module, kind: str, cpu: float) -> float:
        """How long the block should take on this device."""
        if self.block_s is None:
            return self.slowdown * cpu
        call, per_sample, ratio = self.block_s
        forward = (call + per_sample * self._batch.get(id(module), 1)) * self.speed_ratio
        # Full recompute runs the block's forward again inside its backward, past the forward hooks.
        return forward * ((ratio + self.recompute_full) if kind == "backward" else 1.0)

    def _stop(self, module: nn.Module, kind: str) -> None:
        began = self._started.pop(id(module), None)
        if began is None:
            return
        self.slowed[kind] += 1
        # The block should take slowdown × its CPU time. CPU time, not wall time: a rank waiting for a
        # core shared with other ranks has not computed, and must not be stretched for it.
        wall, cpu = time.perf_counter() - began[0], time.thread_time() - began[1]
        extra = max(0.0, self._target(module, kind, cpu) - wall)
        self.compute_s += cpu
        self.slept_s += extra
        time.sleep(extra)

    def _stop_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._stop(module, "forward")

    def _start_backward(self, module: nn.Module, grad_output: Any) -> None:
        self._start(module)

    def _stop_backward(self, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        self._stop(module, "backward")

    # ---------------------------------------------------------------- links
    def slow_links(self, ddp: nn.Module, devices: list[int]) -> None:
        """Delay each of DDP's gradient all-reduces by what it takes over the slowest link among
        ``devices`` (the cluster devices of this rank's data-parallel group) — on top of the real
        local transfer."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        group = ddp.process_group

        def delayed_all_reduce(state, bucket):  # no annotations: DDP checks them, and ours are strings
            buffer = bucket.buffer()
            self.delay_all_reduce(devices, buffer.numel() * buffer.element_size())
            return default_hooks.allreduce_hook(group, bucket)

        ddp.register_comm_hook(None, delayed_all_reduce)

    def slow_sharding(
        self, blocks: Iterable[nn.Module], devices: list[int], zero: int, root: nn.Module | None = None
    ) -> None:
        """Delay FSDP's collectives (ZeRO-2/3) block by block over the slowest link among ``devices``
        (the rank's data-parallel group), as FSDP issues them and the cost model counts them: every
        forward gathers the block's parameters (they were resharded after the last backward, and
        under ZeRO-3 after the forward too, so its backward gathers again), and the backward that
        synchronises gradients reduce-scatters them (not those inside ``no_sync``). ``root``: the
        module wrapped around the blocks, a unit of its own. Works on logical sizes, so it may run
        before or after sharding."""
        link = self._worst_link(devices)
        blocks = list(blocks)
        inside = {id(p) for b in blocks for p in b.parameters()}
        units = [(b, 4 * sum(p.numel() for p in b.parameters())) for b in blocks]
        if root is not None:  # the root unit: what no block holds (embeddings, final norm, head)
            units.append((root, 4 * sum(p.numel() for p in root.parameters() if id(p) not in inside)))
        for block, nbytes in units:
            half = link.all_reduce_s(nbytes, len(devices)) / 2  # one all-gather or one reduce-scatter
            block.register_forward_pre_hook(lambda *_, s=half: self._sleep_link(s))

            def backward_share(module: nn.Module, s: float = half) -> None:
                self._sleep_link(s * ((zero == 3) + _reduces_gradients(module)))

            if block is root:  # its inputs (token ids) need no gradient: hook its output's gradient instead

                def on_root_output(module: nn.Module, _: Any, output: Any, share=backward_share) -> None:
                    graded = [t for t in _tensors(output) if t.requires_grad]  # returns None: the output is kept
                    if graded:
                        graded[0].register_hook(lambda g: share(module))

                block.register_forward_hook(on_root_output)
            else:
                block.register_full_backward_hook(lambda m, *_, share=backward_share: share(m))

    def slow_transfers(self, stage: nn.Module, previous: int | None, following: int | None) -> None:
        """Delay a pipeline stage's inputs from the device of the stage before (``previous``) and its
        output gradients from the device of the stage after (``following``) by their link's time."""
        devices = self.cluster.devices()
        me = devices[self._device][0]

        def nbytes(tensors: Any) -> int:
            return sum(t.numel() * t.element_size() for t in _tensors(tensors))

        if previous is not None and previous != self._device:
            back = self.cluster.link(devices[previous][0], me)
            stage.register_forward_pre_hook(lambda _, args: self._sleep_link(back.seconds(nbytes(args))))
        if following is not None and following != self._device:
            ahead = self.cluster.link(me, devices[following][0])

            def on_output(_: nn.Module, __: Any, output: Any) -> None:  # its gradient arrives from the next stage
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(lambda g: self._sleep_link(ahead.seconds(g.numel() * g.element_size())))

            stage.register_forward_hook(on_output)

    def _worst_link(self, devices: list[int]) -> Any:
        all_devices = self.cluster.devices()
        return self.cluster.worst_link({all_devices[d][0] for d in devices})

    def _sleep_link(self, seconds: float) -> None:
        if not self.links:
            return
        self.link_s += seconds
        time.sleep(seconds)

    def delay_all_reduce(self, devices: list[int], nbytes: int) -> None:
        """Sleep as long as an all-reduce of ``nbytes`` among cluster ``devices`` takes over their slowest link."""
        self._sleep_link(self._worst_link(devices).all_reduce_s(nbytes, len(devices)))

    # --------------------------------------------------------------- memory
    def track_activations(self, params: Iterable[torch.Tensor]) -> None:
        """Count bytes saved for backward from now on, on this thread (parameters excluded)."""
        self._saved = SavedBytes(exclude=params)
        self._saved_hooks = self._saved.track()
        self._saved_hooks.__enter__()  # for the rest of the process: every forward is counted

    def check_memory(self, model: nn.Module, optimizer: Any | None = None, on_host: Collection[str] = ()) -> int:
        """Raise if this rank's model state plus its peak saved activations since the last check do
        not fit the device; return the bytes counted. ``on_host``: the parts of the model state
        ("params", "grads", "optimizer") that offload keeps in host memory (here the CPU plays both)."""
        state = model_state_bytes(model, optimizer)
        activations = self._saved.peak if self._saved is not None else 0
        if self._saved is not None:
            self._saved.peak = self._saved.live  # the next check sees the next step's peak
        used = sum(getattr(state, part) for part in ("params", "grads", "optimizer") if part not in on_host)
        used += activations
        if used > self.capacity:
            raise EmulatedOutOfMemory(
                f"{self.describe()}: this rank needs {used / 2**30:.3g} GiB ({state!r}, on the host: "
                f"{', '.join(on_host) or 'nothing'}; activations "
                f"{activations}) but the device has {self.capacity / 2**30:.3g} GiB usable: shard more (Plan.zero), "
                "recompute activations, split the model (Plan.pp/tp), or give this device a smaller part."
            )
        return used


class EmulationHooks(Hooks):
    """The runtime's hook points (:class:`tessera.runtime.Hooks`) played by an :class:`Emulator`:
    this rank becomes the cluster device the Plan places it on.

    Example:
        >>> booster = tessera.Booster(plan, hooks=EmulationHooks("cluster.yaml"))
    """

    def __init__(self, cluster: Cluster | str | Path) -> None:
        self.cluster = cluster
        self.emulator: Emulator | None = None
        self.plan: Plan | None = None

    def bind(self, plan: Plan, rank: int) -> None:
        if plan.groups is not None:
            raise NotSupportedYet(
                "emulating Plan.groups is not supported yet: the emulator does not pace the traffic across groups "
                "(and DDP takes one communication hook: the groups' or the emulator's); run them without emulation."
            )
        self.plan = plan
        self.emulator = Emulator.from_environment(self.cluster, plan.device_of(rank), plan.precision)
        self.emulator.recompute_full = plan.recompute == "full"

    def _bound(self) -> tuple[Emulator, Plan]:
        assert self.emulator is not None and self.plan is not None, "the Booster binds the hooks first"
        return self.emulator, self.plan

    def _devices(self, ranks: Iterable[int]) -> list[int]:
        return [self._bound()[1].device_of(r) for r in ranks]

    def describe(self) -> str | None:
        return self._bound()[0].describe()

    def node(self) -> str | None:
        return self._bound()[0].node

    def on_model(self, model: nn.Module, blocks: Sequence[nn.Module]) -> None:
        emulator = self._bound()[0]
        emulator.slow_down(blocks)
        emulator.track_activations(model.parameters())

    def on_sharded(self, module: nn.Module, blocks: Sequence[nn.Module], ranks: Sequence[int]) -> None:
        emulator, plan = self._bound()
        emulator.slow_sharding(blocks, self._devices(ranks), plan.zero, root=module)

    def on_replicated(self, wrapped: nn.Module, ranks: Sequence[int]) -> None:
        self._bound()[0].slow_links(wrapped, self._devices(ranks))

    def on_stage(self, stage: nn.Module, previous_rank: int | None, next_rank: int | None) -> None:
        emulator, plan = self._bound()
        emulator.slow_transfers(
            stage,
            plan.device_of(previous_rank) if previous_rank is not None else None,
            plan.device_of(next_rank) if next_rank is not None else None,
        )

    def before_all_reduce(self, ranks: Sequence[int], nbytes: int) -> None:
        self._bound()[0].delay_all_reduce(self._devices(ranks), nbytes)

    def after_backward(self, model: nn.Module, optimizer: Any | None) -> None:
        emulator, plan = self._bound()
        on_host: tuple[str, ...] = ()
        if plan.offload:  # as the cost model has it: ZeRO-2 keeps parameters, ZeRO-1 gradients too
            on_host = ("optimizer", "grads", "params")[: plan.zero]
        emulator.check_memory(model, optimizer, on_host)


EMULATE_ENV = "TESSERA_EMULATE"  # a cluster file whose devices the ranks play (tessera train --emulate)


def hooks_from_environment() -> EmulationHooks | None:
    """Emulation hooks when ``TESSERA_EMULATE`` names a cluster file (``tessera train --emulate``
    sets it for every rank), else None. Read by the entry points, never by the runtime."""
    path = os.environ.get(EMULATE_ENV)
    return EmulationHooks(path) if path else None
