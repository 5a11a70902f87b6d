"""`tessera plan --model --cluster --global-batch`: a table, a Plan file, a picture; clear errors."""

from __future__ import annotations

from pathlib import Path

from tessera.cli import main
from tessera.plan import Plan

CLUSTER = """\
nodes:
  - {name: a, devices: [{type: A100-80GB, count: 2}]}
  - {name: b, devices: [{type: T4, count: 2}]}
"""


def _run(tmp_path: Path, capsys, cluster: str, *extra: str) -> tuple[int, str, str]:
    (tmp_path / "cluster.yaml").write_text(cluster)
    demo = Path(__file__).parents[1] / "examples" / "demo.yaml"
    code = main(
        ["plan", "--model", str(demo), "--cluster", str(tmp_path / "cluster.yaml"),
         "--out", str(tmp_path / "plan.yaml"), "--png", str(tmp_path / "plan.png"), *extra]
    )  # fmt: skip
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_table_writes_plan_and_picture(tmp_path: Path, capsys) -> None:
    code, out, _ = _run(tmp_path, capsys, CLUSTER, "--global-batch", "16", "--top", "3")
    assert code == 0
    assert "best plans for Llama" in out and "tokens/s" in out and "bottleneck" not in out.splitlines()[0]
    assert len([line for line in out.splitlines() if line.startswith(" ") and line[:3].strip().isdigit()]) == 3
    plan = Plan.load(tmp_path / "plan.yaml")
    assert plan.resolve(4).dp * plan.tp * plan.pp == 4
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_plan_refuses_a_global_batch_smaller_than_the_data_parallel_ranks(tmp_path: Path, capsys) -> None:
    five = CLUSTER.replace("A100-80GB, count: 2", "A100-80GB, count: 3")  # 5 devices: only dp=5 fits 4 layers
    code, _, err = _run(tmp_path, capsys, five, "--global-batch", "1")
    assert code == 2
    assert "tessera: error: global_batch_size=1 is smaller than the number of data-parallel ranks" in err
