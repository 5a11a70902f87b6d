"""One prepared GPU check (≤ 8 minutes on one H100/H200): what only a GPU can show.

1. **Step time and MFU**, bf16, a ~1 B-parameter Llama (dim 2048, 16 layers, seq 2048, batch 4)
   on one GPU: Tessera (``ZeRO(stage=3, precision="bf16")``, FSDP2 underneath) against plain
   PyTorch FSDP2 with the same mixed-precision policy, each eager and with every block compiled
   (Tessera: ``Plan(compile="blocks")``), and compiled with FP8 (Tessera: ``precision="fp8"``; FSDP2:
   torchao's float8 linears in the blocks, weights gathered in float8, as torchtitan does it; MFU still
   against the bf16 peak). Interleaved: each repetition runs every system once on a fresh model.
   torchtitan 0.3.0 beside them: its own Llama at the same shape laid out by its own ``parallelize_llama``
   (FSDP2, per-block compile, its float8 converter: rowwise), in the same plain step
   (``benchmarks/torchtitan_system.py`` says why not its Trainer); where it does not import, its columns
   carry the reason instead of figures.
   MFU = (6 × parameters + 12 × layers × dim × seq) × tokens per second / the device's bf16 dense peak
   (from the catalogue): the weights' FLOPs and attention's (PaLM, appendix B).
2. **CPU offload parity on CUDA** (offload moves nothing on CPU, so only here is it tested):
   ``ZeRO(stage=3, offload=True)`` against ``ZeRO(stage=3)`` on a small model, a few fp32 steps:
   losses within 1e-5 relative, and the offloaded parameters' shards really live on the host.

``--tiny`` runs the same code on CPU with a tiny model in seconds (the test suite does, so the
script keeps working between GPU sessions); its figures mean nothing.

    python benchmarks/gpu_check.py --json gpu_check.json          # on the GPU machine
    python benchmarks/gpu_check.py --tiny --json /tmp/tiny.json   # anywhere

torchtitan on a machine without network: ``make gpu-wheels`` here, then carry ``.gpu_wheels`` and run
``pip install --no-deps --no-index .gpu_wheels/*.whl`` there first (triton comes with a CUDA torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

BIG = {"dim": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 8, "ffn_dim": 5632, "vocab_size": 32000}
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 256}
SYSTEMS = (
    "tessera-zero3",
    "tessera-zero3-compiled",
    "tessera-zero3-compiled-fp8",
    "torch-fsdp2",
    "torch-fsdp2-compiled",
    "torch-fsdp2-compiled-fp8",
    "torchtitan",
    "torchtitan-compiled",
    "torchtitan-compiled-fp8",
)


def llama(shape: dict, seq: int, device: torch.device | None = None) -> torch.nn.Module:
    """The check's Llama, initialised on ``device`` (a 1 B model takes seconds to initialise on a CPU)."""
    from tessera.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return Llama(LlamaConfig(max_seq_len=seq, **shape))


def batches(shape: dict, batch: int, seq: int, device: torch.device, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, shape["vocab_size"], (batch, seq + 1), generator=g).to(device) for _ in range(n)]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ step time and MFU
def run_system(name: str, shape: dict, seq: int, batch: int, steps: int, device: torch.device, dtype: str) -> float:
    """Median seconds per training step of ``name`` (after two warm-up steps)."""
    import tessera

    data = batches(shape, batch, seq, device, steps + 2)
    fp8 = name.endswith("fp8")  # bf16 around the blocks' float8 linears (emulated in tiny mode)
    if name.startswith("torchtitan"):
        import torchtitan_system

        if (reason := torchtitan_system.available()) is not None:
            raise RuntimeError(reason)
        step = torchtitan_system.build(shape, seq, device, "compiled" in name, fp8, dtype)
        return _median_step(step, data, device)
    model = llama(shape, seq, device)
    if name.startswith("tessera-zero3"):
        compiled = "blocks" if "compiled" in name else "none"  # tiny mode: TESSERA_COMPILE_BACKEND=eager
        precision = {"precision": "fp8", "fp8_emulate": device.type != "cuda"} if fp8 else {"precision": dtype}
        booster = tessera.Booster(tessera.Plan(zero=3, compile=compiled, **precision))
        model, opt = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step(tokens: torch.Tensor) -> None:
            booster.backward(loss_of(model, tokens), opt)
            opt.step()
            opt.zero_grad()

    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        low = torch.bfloat16 if fp8 else {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        if fp8:  # torchtitan's recipe by hand: torchao float8 linears in the blocks, weights gathered in float8
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=device.type != "cuda")
            for block in model.layers:
                convert_to_float8_training(block, config=config)
        for block in model.layers:
            if "compiled" in name:  # tiny mode: dynamo's tracing without code generation, for speed
                block.compile(backend="inductor" if device.type == "cuda" else "eager")
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(tokens: torch.Tensor) -> None:
            loss_of(model, tokens).backward()
            opt.step()
            opt.zero_grad()

    return _median_step(step, data, device)


def _median_step(step: Callable[[torch.Tensor], None], data: list[torch.Tensor], device: torch.device) -> float:
    """Median seconds of ``step`` over ``data``, the first two steps (warm-up, compilation) left out."""
    times = []
    for i, tokens in enumerate(data):
        sync(device)
        start = time.perf_counter()
        step(tokens)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_times(
    shape: dict,
    seq: int,
    batch: int,
    steps: int,
    reps: int,
    device: torch.device,
    dtype: str,
    deadline: float = float("inf"),
    progress: Callable[[dict], None] = lambda _: None,
) -> dict:
    """Every system's median step over ``reps`` interleaved repetitions; no new repetition starts after
    ``deadline`` (time.monotonic()), and ``progress`` gets the figures so far after every run."""
    params = sum(p.numel() for p in llama(shape, seq, torch.device("meta")).parameters())
    per_token = 6 * params + 12 * shape["n_layers"] * shape["dim"] * seq  # weights and attention
    runs: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    errors: dict[str, str] = {}
    for rep in range(reps):
        if rep and time.monotonic() > deadline:
            print(f"time budget spent: stopping after {rep} repetitions", flush=True)
            break
        for name in SYSTEMS[rep % len(SYSTEMS) :] + SYSTEMS[: rep % len(SYSTEMS)]:  # rotated order
            try:
                runs[name].append(run_system(name, shape, seq, batch, steps, device, dtype))
            except Exception as exc:  # one system failing must not cost the others' figures
                errors.setdefault(name, f"{type(exc).__name__}: {exc}"[:2000])
                print(f"rep {rep} {name}: FAILED {errors[name]}", flush=True)
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the last system's model is gone: hand its memory back
            print(f"rep {rep} {name:22s} {runs[name][-1]:.4f} s/step", flush=True)
            progress({**summarise(runs, params, per_token, batch * seq, device, dtype), "errors": errors})
    return {**summarise(runs, params, per_token, batch * seq, device, dtype), "errors": errors}


def summarise(
    runs: dict[str, list[float]], params: int, per_token: float, batch_seq: int, device: torch.device, dtype: str
) -> dict:
    """Medians, TFLOP/s (``per_token`` training FLOPs a token, attention counted), MFU and ratios to plain FSDP2
    (eager and compiled) of the runs so far."""
    from tessera.cluster.catalog import CATALOG

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    entry = next((t for key, t in CATALOG.items() if key.split("-")[0] in name), None)
    peak = entry.peak(dtype) if entry is not None else None
    out = {"device": name, "params": params, "flops_per_token": per_token, "tokens_per_step": batch_seq,
           "peak_tflops": peak, "systems": {}}  # fmt: skip
    for system, times in runs.items():
        if not times:
            continue
        step = statistics.median(times)
        tflops = per_token * batch_seq / step / 1e12
        out["systems"][system] = {
            "step_s": step,
            "runs_s": times,
            "tflops": tflops,
            "mfu": tflops / peak if peak else None,
        }
    base = out["systems"].get("torch-fsdp2", {}).get("step_s")
    compiled = out["systems"].get("torch-fsdp2-compiled", {}).get("step_s")
    for row in out["systems"].values():
        row["step_over_torch_fsdp2"] = row["step_s"] / base if base else None
        row["step_over_torch_fsdp2_compiled"] = row["step_s"] / compiled if compiled else None
    return out


def matmul_ceiling(device: torch.device, dtype: str, size: int) -> float:
    """TFLOP/s of one size³ matrix product on random data, median of ten after three warm-ups: what
    this device really reaches, beside the datasheet peak that MFU divides by."""
    low = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    a, b = (torch.randn(size, size, device=device, dtype=low) for _ in range(2))
    times = []
    for i in range(13):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12


# ------------------------------------------------------------------ offload parity
def offload_parity(device: torch.device, steps: int = 4) -> dict:
    """ZeRO-3 with and without CPU offload: same losses, and the offloaded shards on the host."""
    import tessera

    shape, seq = {**TINY, "dim": 128}, 64
    data = batches(shape, 4, seq, device, steps)
    results: dict[str, Any] = {}
    for offload in (False, True):
        model = llama(shape, seq, device)
        booster = tessera.Booster(tessera.ZeRO(stage=3, offload=offload))
        model, opt = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses = []
        for tokens in data:
            loss = loss_of(model, tokens.to(device))
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(float(booster.reduce_loss(loss)))
        homes = {str(tessera.distributed.local(p).device) for p in model.parameters()}
        results["offload" if offload else "resident"] = {"losses": losses, "parameter_devices": sorted(homes)}
    ref, off = results["resident"]["losses"], results["offload"]["losses"]
    results["max_relative_loss_difference"] = max(abs(a - b) / abs(a) for a, b in zip(ref, off))
    results["offloaded_to_host"] = results["offload"]["parameter_devices"] == ["cpu"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="CPU, a tiny model, seconds: keeps the script working")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--json")
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no step-time repetition after this")
    args = ap.parse_args()

    import tessera

    tessera.init()
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shape, seq, batch = (BIG, 2048, 4) if cuda else (TINY, 32, 2)
    reps, steps = args.reps or (3 if cuda else 1), args.steps or (6 if cuda else 2)
    dtype = "bf16" if cuda else "fp32"
    if not cuda:  # tiny mode: dynamo's tracing without code generation (inductor on CPU takes minutes cold)
        os.environ.setdefault("TESSERA_COMPILE_BACKEND", "eager")
    start = time.monotonic()
    import torchtitan_system

    out: dict[str, Any] = {
        "mode": "gpu" if cuda else "tiny cpu (figures mean nothing)",
        "dtype": dtype,
        "torch": torch.__version__,
        "torchtitan": torchtitan_system.available() or f"torchtitan {torchtitan_system.VERSION} imported",
    }

    def write(partial: dict | None = None) -> None:  # after every figure: a run cut short keeps what it had
        if partial is not None:
            out["step_time"] = partial
        out["wall_s"] = time.monotonic() - start
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    # Offload parity first: it takes seconds, and it is the part no CPU run can check.
    try:
        out["offload_parity"] = offload_parity(device)
    except Exception as exc:  # recorded, and the step times still run
        out["offload_parity"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    out["matmul_tflops"] = matmul_ceiling(device, dtype, 8192 if cuda else 256)
    write()
    out["step_time"] = step_times(shape, seq, batch, steps, reps, device, dtype, start + args.budget_s, write)
    write()
    for system, row in out["step_time"]["systems"].items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        ratio = f"x{row['step_over_torch_fsdp2']:.2f}" if row["step_over_torch_fsdp2"] else "n/a"
        compiled = row["step_over_torch_fsdp2_compiled"]
        print(f"{system:22s} {row['step_s']:.4f} s/step  {row['tflops']:.1f} TFLOP/s  MFU {mfu}  "
              f"step {ratio} of torch-fsdp2's, x{compiled or float('nan'):.2f} of torch-fsdp2-compiled's")  # fmt: skip
    print(f"one {dtype} matrix product: {out['matmul_tflops']:.1f} TFLOP/s")
    parity = out["offload_parity"]
    if "error" in parity:
        print(f"offload parity FAILED: {parity['error']}")
        raise SystemExit(1)
    print(f"offload parity: max relative loss difference {parity['max_relative_loss_difference']:.2e}, "
          f"offloaded parameters on {parity['offload']['parameter_devices']}")  # fmt: skip
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
