"""Datasheet figures of common device types, so a cluster file can say ``type: A100-80GB`` and nothing else.

Peaks are dense (no structured sparsity) tensor-core TFLOP/s per dtype, as the vendors publish
them; ``fp32`` is the plain (non-TF32) figure; ``fp8`` only where the device has FP8 tensor cores (Ada,
Hopper), with fp32 accumulation. ``memory_gib`` is what a framework sees (the
"80 GB" of an A100 is 79.2 GiB), ``bandwidth_gbs`` the memory bandwidth in GB/s. A dtype a
device has no fast path for (bf16 on T4 and V100) is absent: a plan asking for it is refused.

AMD MI250X is listed per GCD, the unit a process sees as one device (a package holds two).
"cpu" is a nominal entry for emulation and tests; ``tessera cluster detect`` measures the local
CPU's memory and states its peak as unknown unless given.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator: peak TFLOP/s per dtype, memory and memory bandwidth."""

    name: str
    peak_tflops: dict[str, float] = field(default_factory=dict)  # dtype ("fp32", "bf16", "fp16", "fp8") -> TFLOP/s
    memory_gib: float = 0.0
    bandwidth_gbs: float = 0.0
    # Memory speed of the host an offloaded optimizer steps on (None: the planner's default host).
    # A measured CPU "device" is its own host: offloading then moves nothing and gains nothing.
    host_bandwidth_gbs: float | None = None
    # Share of a concurrent collective's time the device's compute does not lose to it: 1 where copy
    # engines and NCCL move the bytes; lower where the collective's copies and reductions take the
    # compute's processor time. Measured by a live profile; the simulator reads it.
    comm_overlap: float = 1.0

    def peak(self, dtype: str) -> float | None:
        """Dense peak for ``dtype`` (None: no fast path for it on this device)."""
        return self.peak_tflops.get(dtype)


def _dev(
    name: str,
    fp32: float,
    half: float | None,
    memory_gib: float,
    bandwidth_gbs: float,
    bf16: bool = True,
    fp8: float | None = None,
) -> DeviceType:
    peaks = {"fp32": fp32}
    if half is not None:
        peaks["fp16"] = half
        if bf16:
            peaks["bf16"] = half
    if fp8 is not None:
        peaks["fp8"] = fp8
    return DeviceType(name, peaks, memory_gib, bandwidth_gbs)


CATALOG: dict[str, DeviceType] = {
    d.name: d
    for d in (
        _dev("H100", 67.0, 989.0, 79.6, 3350.0, fp8=1979.0),  # SXM5 80 GB
        _dev("H200", 67.0, 989.0, 139.8, 4800.0, fp8=1979.0),  # SXM 141 GB
        _dev("A100-80GB", 19.5, 312.0, 79.2, 2039.0),  # SXM4
        _dev("A100-40GB", 19.5, 312.0, 39.4, 1555.0),  # SXM4
        _dev("A10", 31.2, 125.0, 22.1, 600.0),
        _dev("L4", 30.3, 121.0, 22.0, 300.0, fp8=242.5),
        _dev("T4", 8.1, 65.0, 14.7, 320.0, bf16=False),
        _dev("V100", 15.7, 125.0, 31.7, 900.0, bf16=False),  # SXM2 32 GB
        _dev("RTX4090", 82.6, 165.2, 23.6, 1008.0, fp8=330.3),  # fp16/bf16/fp8 with fp32 accumulation
        _dev("RTX3090", 35.6, 71.0, 23.6, 936.0),
        _dev("A6000", 38.7, 154.8, 47.5, 768.0),  # RTX A6000
        _dev("MI250X", 23.9, 191.5, 64.0, 1638.0),  # one GCD (half a package)
        _dev("cpu", 1.0, 1.0, 16.0, 50.0),  # nominal: emulation and tests
    )
}

# Other spellings users write, mapped to catalogue names.
ALIASES = {
    "H100-80GB": "H100",
    "H100-SXM": "H100",
    "H200-141GB": "H200",
    "A100": "A100-80GB",
    "A100-80G": "A100-80GB",
    "A100-40G": "A100-40GB",
    "V100-32GB": "V100",
    "RTX-4090": "RTX4090",
    "RTX-3090": "RTX3090",
    "RTX-A6000": "A6000",
}


def lookup(name: str) -> DeviceType | None:
    """The catalogue entry for ``name`` or one of its aliases (case-insensitive), else None."""
    wanted = name.strip().lower()
    for key in (*CATALOG, *ALIASES):
        if key.lower() == wanted:
            return CATALOG[ALIASES.get(key, key)]
    return None
