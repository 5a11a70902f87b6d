"""Compiled blocks (issue 34, item 1; Plan.compile="blocks"): each block's forward compiled on its own with
torch.compile (inductor's CPU backend here), in DDP and ZeRO-1/2/3 layouts, trains like one eager process.

Tolerance: the parity tests' own (fp32, rtol 1e-5, atol 1e-5). Inductor fuses and reorders float operations
inside a block (its generated kernels, not ATen's), so results differ from eager in the last bits (logits
~2e-7 apart on these models); three AdamW steps keep that far inside 1e-5. The compiled parity cases share one
launch, and run first so the single-process tests below find their graphs in inductor's cache."""

from __future__ import annotations

import pytest
import torch
from parity import SEQ, VOCAB, compare_cases, tessera_run

import tessera
from tessera.errors import NotSupportedYet
from tessera.models import Llama, LlamaConfig
from tessera.parallel import compile as compiled_blocks
from tessera.parallel.compile import RecompileWatch, apply_compile, compile_counts
from tessera.parallel.recompute import apply_recompute

STEPS = 3
GLOBAL_BATCH = 8
COMPILED = {
    "ddp": tessera.Plan(compile="blocks"),
    "zero1": tessera.Plan(zero=1, compile="blocks"),
    "zero2": tessera.Plan(zero=2, compile="blocks"),
    "zero3": tessera.Plan(zero=3, compile="blocks"),
    "zero3 offload": tessera.Plan(zero=3, offload=True, compile="blocks"),
    "zero3 full recompute": tessera.Plan(zero=3, recompute="full", compile="blocks"),
}


def compiled_cases_worker(cases: list[tuple], global_batch: int, steps: int) -> tuple[dict, int]:
    """Each case's training, and how many graphs this rank compiled in all (none: compile was not applied)."""
    # no forward-only pass: its graph would be one more compilation (25 s cold here) for the suite
    results = {name: tessera_run(plan, kind, global_batch, steps, evaluate=False) for name, plan, kind, _ in cases}
    return results, compile_counts()["graphs"]


def test_compiled_blocks_train_like_one_process_in_every_data_parallel_layout() -> None:
    from tessera.testing import run_ranks

    cases = [(f"llama {name} compiled", plan.to_dict(), "llama", None) for name, plan in COMPILED.items()]
    results, graphs = run_ranks(compiled_cases_worker, 2, cases, GLOBAL_BATCH, STEPS, timeout_s=600)[0]
    assert graphs > 0, "no block was compiled"
    compare_cases(results, cases, GLOBAL_BATCH, STEPS)


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                             max_seq_len=SEQ))  # fmt: skip


def _saved_bytes(model: Llama, x: torch.Tensor) -> int:
    """Bytes autograd keeps from the forward for the backward."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.float().sum().backward()
    return saved[0]


def test_a_fixed_shape_run_compiles_once_and_recompute_stays_inside_the_compiled_blocks() -> None:
    """Steps of one shape compile at the first and never again; with recompute the compiled blocks keep
    only what the recompute keeps (a recompute wrapper lost under compile keeps every activation)."""
    x = torch.randint(0, VOCAB, (GLOBAL_BATCH // 2, SEQ))  # a rank's batch in the parity cases: cached graphs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank runs (inductor's cache key holds the thread count)
    try:
        _compile_once_and_recompute_inside(x)
    finally:
        torch.set_num_threads(threads)


def _compile_once_and_recompute_inside(x: torch.Tensor) -> None:
    plain, recomputed = _model(), _model()
    apply_compile(list(plain.layers), "blocks")
    apply_recompute(list(recomputed.layers), "full")
    apply_compile(list(recomputed.layers), "blocks")
    watch = RecompileWatch()
    full = _saved_bytes(plain, x)
    first = compile_counts()["graphs"]
    assert first > watch.last, "the blocks did not compile"
    for _ in range(3):
        _saved_bytes(plain, x)
    assert compile_counts()["graphs"] == first, "a run of one shape compiled again after its first step"
    assert _saved_bytes(recomputed, x) < 0.6 * full


def test_compilations_that_keep_coming_are_warned_of_once(monkeypatch: pytest.MonkeyPatch) -> None:
    graphs = iter([0, 2, 2, 3, 4, 5, 6, 6])  # the first report compiles; then three in a row, once more, a pause
    monkeypatch.setattr(compiled_blocks, "compile_counts", lambda: {"graphs": next(graphs), "seconds": 1.0})
    watch = RecompileWatch(storm_reports=3)
    warnings = [watch.report()[1] for _ in range(7)]
    assert [w is not None for w in warnings] == [False, False, False, False, True, False, False], warnings
    assert "compiled again at 3 reports in a row (5 graphs" in warnings[4]
    assert "Pad or pack the data to data.seq_len" in warnings[4]


@pytest.mark.parametrize(
    "plan,named",
    [
        (tessera.Plan(tp=2, compile="blocks"), "Plan.tp=2"),
        (tessera.Plan(pp=2, pipeline={"microbatches": 2}, compile="blocks"), "Plan.pp=2"),
        (tessera.Plan(sp=2, compile="blocks"), "Plan.sp=2"),
        (tessera.Plan(zero=2, precision="bf16", compile="blocks"), "Plan.precision='bf16'"),
        (tessera.Plan(compile="blocks", groups={"count": 2, "sync": "diloco", "inner_steps": 2}), "Plan.groups="),
    ],
)
def test_what_does_not_compile_yet_is_refused_by_name(plan: tessera.Plan, named: str) -> None:
    with pytest.raises(NotSupportedYet, match=f"Plan.compile='blocks' with {named}.*not supported yet"):
        plan.resolve(4)
