"""Heterogeneous-issue part 2: the profiler measures per-layer costs, caches them, and scales them
to device types it cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from parity import build_model

from tessera.cluster import CATALOG
from tessera.memory import SavedBytes
from tessera.planner.profile import Profile, cached_profile, measure_links, profile_model, scale_profile
from tessera.testing import run_ranks


@pytest.fixture(scope="module")
def llama_profile() -> Profile:
    return profile_model(build_model("llama:4"), batch_sizes=(1, 2, 4), seq_len=16, repeats=2)


def test_profile_counts_parameters_exactly_and_times_every_part(llama_profile: Profile) -> None:
    model = build_model("llama:4")
    block = sum(p.numel() * 4 for p in model.layers[0].parameters())
    assert llama_profile.layers["block"].param_bytes == block
    assert llama_profile.layers["first"].param_bytes == model.tok_embeddings.weight.numel() * 4
    assert llama_profile.n_layers == 4
    for name, part in llama_profile.layers.items():
        assert all(t > 0 for t in part.forward_s.values()), name
        assert set(part.backward_s) == {1, 2, 4}, name


def test_activation_bytes_grow_with_the_micro_batch(llama_profile: Profile) -> None:
    saved = llama_profile.layers["block"].activation_bytes
    assert saved[1] > 0
    assert saved[2] == 2 * saved[1] and saved[4] == 4 * saved[1]  # per-sample activations, nothing shared


def test_saved_bytes_counts_what_backward_keeps() -> None:
    x = torch.randn(8, 16, requires_grad=True)
    z = torch.randn(8, 16, requires_grad=True)
    counter = SavedBytes()
    with counter.track():
        y = (x * z).sum()  # mul saves both inputs: 2 x 8 x 16 x 4 bytes
    assert counter.peak == 2 * 8 * 16 * 4
    del y
    assert counter.live == 0  # freed with the graph
    with counter.track():
        y = (x * x).sum() + x.t().sum()  # one storage, saved twice and seen through a view: held once
    assert counter.live == 8 * 16 * 4
    del y
    assert counter.live == 0


def test_profiles_are_cached_and_scaled_by_peak_ratio(tmp_path: Path) -> None:
    model = build_model("hf_llama")
    first = cached_profile(tmp_path, model, "cpu", batch_sizes=(1,), seq_len=16, repeats=1)
    again = cached_profile(tmp_path, model, "cpu", batch_sizes=(1,), seq_len=16, repeats=1)
    assert again == first  # read back from the cache, not re-measured
    assert len(list(tmp_path.iterdir())) == 1
    a100, h100 = CATALOG["A100-80GB"], CATALOG["H100"]
    scaled = scale_profile(first, a100, h100, "bf16")
    assert scaled.scaled_from == "A100-80GB" and scaled.device_type == "H100"
    ratio = 312.0 / 989.0
    assert scaled.layers["block"].forward_s[1] == pytest.approx(first.layers["block"].forward_s[1] * ratio)
    assert scaled.layers["block"].activation_bytes == first.layers["block"].activation_bytes
    with pytest.raises(ValueError, match="T4 has no bf16 figure"):
        scale_profile(first, a100, CATALOG["T4"], "bf16")


def test_profile_works_for_every_family_with_a_layout() -> None:
    for kind in ("gpt2", "hf_qwen2"):
        prof = profile_model(build_model(kind), batch_sizes=(1,), seq_len=16, repeats=1)
        assert prof.layers["block"].forward_s[1] > 0 and prof.layers["last"].param_bytes > 0, kind


def links_worker() -> dict:
    return measure_links(sizes=(1 << 12, 1 << 16), repeats=2)


def test_link_bandwidth_is_measured_on_the_group() -> None:
    got = run_ranks(links_worker, 2)[0]
    assert set(got) == {"all_reduce", "p2p", "latency_us"}
    assert all(v > 0 for kind in got.values() for v in kind.values())
