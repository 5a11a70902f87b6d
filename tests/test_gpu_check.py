"""The prepared GPU check (issue 13 item 7) stays runnable: its tiny CPU mode, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_runs_in_its_tiny_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["mode"].startswith("tiny cpu")
    systems, errors = result["step_time"]["systems"], result["step_time"]["errors"]
    assert set(systems) >= {"tessera-zero3", "tessera-zero3-compiled", "tessera-zero3-compiled-fp8", "torch-fsdp2",
                            "torch-fsdp2-compiled", "torch-fsdp2-compiled-fp8"}, errors  # fmt: skip
    assert all(row["step_s"] > 0 and row["tflops"] > 0 for row in systems.values())
    # torchtitan's columns ran, or say why not (the suite does not install it: it needs triton, 286 MB)
    titan = ("torchtitan", "torchtitan-compiled", "torchtitan-compiled-fp8")
    if result["torchtitan"].endswith("imported"):
        assert set(titan) <= set(systems), errors
    else:
        assert all(errors[name].startswith("RuntimeError: torchtitan 0.3.0 does not import here") for name in titan)
    assert set(systems) | set(errors) == {*systems, *titan}
    parity = result["offload_parity"]
    # On CPU offload moves nothing, but the two runs must still train alike.
    assert parity["max_relative_loss_difference"] < 1e-5, parity
    assert len(parity["resident"]["losses"]) == 4
