"""What one sample costs in each part of a model: the numbers the cost model and the simulator read.

A model has three kinds of parts, as a pipeline cuts it: ``first`` (embeddings), ``block`` (one
transformer layer, all alike) and ``last`` (final norm and head). For each part,
:class:`PartCost` holds forward seconds per sample on a reference device of ``ref_tflops``
(a device of peak ``p`` takes ``ref_tflops / p`` times as long), parameter count, and bytes
saved for backward per sample. Backward is ``backward_ratio`` × forward.

Two sources:

- :meth:`ModelCosts.from_model` (analytic): parameter counts from the model itself (built on the
  meta device it costs nothing), forward FLOPs ``2 × params × seq`` plus attention, at an assumed
  fraction ``mfu`` of peak, and activation bytes from the layer's shape.
- :meth:`ModelCosts.from_profile` (measured): a :class:`~tessera.planner.profile.Profile` of this
  device; per part a line ``call + per_sample × b`` fitted to the profiled micro-batch sizes, so
  a device given a small micro-batch is not credited with the per-sample speed of a big one.

Example:
    >>> costs = ModelCosts.from_model(model, seq_len=1024, precision="bf16")
    >>> costs.forward_s("block", samples=4, peak_tflops=989.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from tessera.errors import PlanError

PARTS = ("first", "block", "last")
# fp8: activations and the weights a rank computes with stay bf16 (float8 copies are made per matmul)
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class PartCost:
    """One part of the model, per sample (one sequence)."""

    forward_s: float  # seconds per sample on a device of ModelCosts.ref_tflops
    params: int
    activation_bytes: float  # saved for backward
    call_s: float = (
        0.0  # seconds per call, whatever the micro-batch (launches, Python): small batches cost more per sample
    )
    tensors: int = 0  # parameter tensors (ZeRO-1 broadcasts each one from its owner after every step)


@dataclass(frozen=True)
class ModelCosts:
    """Per-sample costs of a model's parts and the shapes the communication depends on."""

    name: str
    n_layers: int
    seq_len: int
    hidden: int
    parts: dict[str, PartCost]
    precision: str = "fp32"
    ref_tflops: float = 1.0
    backward_ratio: float = 2.0
    source: str = "analytic"
    heads: int = 1  # tensor parallelism must divide this (the gcd of query and key/value head counts)
    shared_params: int = 0  # the last part's parameters that are the first's (a tied head): one copy on one stage
    # Seconds the runtime's wrappers add on the reference device (measured by a live profile; 0: unknown):
    fsdp_unit_s: float = 0.0  # per FSDP unit (a block, or the root) and pass
    # What a tensor-parallel block adds per pass beyond its share of compute and its all-reduces on the link
    # (dispatch, smaller matmuls, waits at blocking collectives): per call, and per sample of the
    # micro-batch (a line, as every other time here: the search assumes times affine in the micro-batch).
    tp_block_s: float = 0.0
    tp_sample_s: float = 0.0
    # The share of a block's saved activations every tensor-parallel rank keeps whole (norm inputs,
    # residuals); the rest is split over tp. Korthikanti et al. (2022): 10 of 34 values per token.
    tp_replicated_activations: float = 10 / 34
    # The loss, per sample, on the stage holding the head (0: unknown). Each micro-batch held for its
    # backward keeps its logits and their fp32 log-softmax; the backward then adds both gradients once.
    # The profiled "last" part saves only the head's input: a forward's output is not saved.
    loss_saved_bytes: float = 0.0
    loss_grad_bytes: float = 0.0
    # Per-stage sums, memoised: the planner asks for the same stages millions of times.
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    # ----------------------------------------------------------------- derived
    @property
    def act_bytes(self) -> int:
        """Bytes per element of activations (the compute dtype)."""
        return ELEMENT_BYTES[self.precision]

    def boundary_bytes(self, samples: float) -> float:
        """Bytes of the hidden states that cross a stage boundary (and a tp all-reduce) for ``samples``."""
        return samples * self.seq_len * self.hidden * self.act_bytes

    def forward_s(self, part: str, samples: float, peak_tflops: float) -> float:
        """Forward seconds of ``part`` for ``samples`` on a device of ``peak_tflops``."""
        cost = self.parts[part]
        return (cost.call_s + cost.forward_s * samples) * self.ref_tflops / peak_tflops

    def tp_activation_share(self, tp: int) -> float:
        """The share of a block's saved activations one of ``tp`` tensor-parallel ranks holds."""
        r = self.tp_replicated_activations
        return r + (1 - r) / tp if tp > 1 else 1.0

    def tp_block_at(self, samples: float) -> float:
        """What a tensor-parallel block adds per pass at a micro-batch of ``samples`` (reference device)."""
        return self.tp_block_s + self.tp_sample_s * samples

    def stage_parts(self, first: int, end: int) -> list[tuple[str, int]]:
        """The parts of a stage holding layers ``[first, end)``, with their multiplicity."""
        parts = [("block", end - first)]
        if first == 0:
            parts.append(("first", 1))
        if end == self.n_layers:
            parts.append(("last", 1))
        return parts

    def stage_params(self, first: int, end: int) -> int:
        key = ("params", first, end)
        if key not in self._memo:
            total = sum(self.parts[p].params * k for p, k in self.stage_parts(first, end))
            self._memo[key] = total - (self.shared_params if first == 0 and end == self.n_layers else 0)
        return self._memo[key]

    def stage_tensors(self, first: int, end: int) -> int:
        """Parameter tensors a stage holding layers ``[first, end)`` keeps."""
        return sum(self.parts[p].tensors * k for p, k in self.stage_parts(first, end))

    def stage_forward_s(self, first: int, end: int, samples: float, peak_tflops: float) -> float:
        key = ("forward", first, end)
        if key not in self._memo:
            parts = [(self.parts[p], k) for p, k in self.stage_parts(first, end)]
            self._memo[key] = (sum(c.call_s * k for c, k in parts), sum(c.forward_s * k for c, k in parts))
        call, per_sample = self._memo[key]
        return (call + per_sample * samples) * self.ref_tflops / peak_tflops

    def edge_activation_bytes(self, first: int, end: int) -> float:
        """Bytes per sample the first and last parts of a stage save (0 for a middle stage)."""
        key = ("edges", first, end)
        if key not in self._memo:
            parts = self.stage_parts(first, end)
            self._memo[key] = sum(self.parts[p].activation_bytes * k for p, k in parts if p != "block")
        return self._memo[key]

    # ----------------------------------------------------------------- sources
    @classmethod
    def from_model(
        cls, model: nn.Module, seq_len: int, precision: str = "fp32", mfu: float = 0.5, name: str | None = None
    ) -> ModelCosts:
        """Analytic costs: exact parameter counts per part, FLOPs from them, at ``mfu`` of peak.

        Activation bytes per block follow Korthikanti et al. (2022) without the s² attention
        term (fused attention keeps no score matrix): ``34 × seq × hidden`` 16-bit values.
        """
        hidden, vocab, n_layers, counts, shared, tensors = _shape(model)
        elem = ELEMENT_BYTES[precision]
        attention_flops = 4 * seq_len * seq_len * hidden  # scores and weighted sum
        per_s = 1.0 / (1e12 * mfu)  # seconds per FLOP on a 1-TFLOP/s device at this mfu
        parts = {
            "first": PartCost(0.0, counts["first"], seq_len * hidden * elem, tensors=tensors["first"]),
            "block": PartCost(  # FLOPs of the parameters a token goes through (an MoE block: its top_k experts)
                (2 * counts["block_active"] * seq_len + attention_flops) * per_s,
                counts["block"],
                34 * seq_len * hidden * elem / 2,
                tensors=tensors["block"],
            ),
            # The head's matmul costs FLOPs even when its weight is the (tied) embedding.
            "last": PartCost(
                2 * hidden * vocab * seq_len * per_s,
                counts["last"],
                seq_len * hidden * elem,  # the head's input (its logits are the loss's, below)
                tensors=tensors["last"],
            ),
        }
        return cls(name or type(model).__name__, n_layers, seq_len, hidden, parts, precision, 1.0,
            heads=_heads(getattr(model, "config", None)), shared_params=shared,
            loss_saved_bytes=seq_len * vocab * (elem + 4), loss_grad_bytes=seq_len * vocab * 8,
        )  # fmt: skip

    @classmethod
    def from_profile(cls, profile: Any, peak_tflops: float, hidden: int, precision: str = "fp32") -> ModelCosts:
        """Measured costs from a :class:`~tessera.planner.profile.Profile` taken on a device of ``peak_tflops``."""
        parts = {}
        for part in PARTS:
            lp = profile.layers[part]
            call, per_sample = fit_line(lp.forward_s)
            b = max(lp.forward_s)
            parts[part] = PartCost(per_sample, lp.param_bytes // 4, lp.activation_bytes[b] / b, call, lp.param_tensors)
        block = profile.layers["block"]
        ratio = sum(block.backward_s.values()) / max(sum(block.forward_s.values()), 1e-12)
        source = f"profile of {profile.device_type}" + (
            f" (scaled from {profile.scaled_from})" if profile.scaled_from else ""
        )
        return cls(
            profile.model_key, profile.n_layers, profile.seq_len, hidden, parts, precision, peak_tflops, ratio, source
        )

    def with_precision(self, precision: str) -> ModelCosts:
        return replace(self, precision=precision, _memo={})


def fit_line(times: dict[int, float]) -> tuple[float, float]:
    """Least-squares ``time = call + per_sample × b`` over the profiled micro-batch sizes (both ≥ 0)."""
    sizes = list(times)
    if len(sizes) == 1:
        return 0.0, times[sizes[0]] / sizes[0]
    mean_b, mean_t = sum(sizes) / len(sizes), sum(times.values()) / len(sizes)
    slope = sum((b - mean_b) * (times[b] - mean_t) for b in sizes) / sum((b - mean_b) ** 2 for b in sizes)
    slope = max(slope, 0.0)
    return max(mean_t - slope * mean_b, 0.0), slope


def _shape(model: nn.Module) -> tuple[int, int, int, dict[str, int], int, dict[str, int]]:
    """Hidden size, vocabulary, layer count, parameter count of each part, the count first and last
    share, and the parameter tensors of each part."""
    from tessera.models.hf_experts import active_params
    from tessera.models.policies import policy_for

    config = getattr(model, "config", None)
    hidden = _first_attr(config, ("dim", "hidden_size", "n_embd"))
    vocab = _first_attr(config, ("vocab_size",))
    if hidden is None or vocab is None:
        raise PlanError(
            f"the planner reads the hidden size and vocabulary from model.config; {type(model).__name__}'s config "
            "has neither dim/hidden_size/n_embd nor vocab_size."
        )
    layout = policy_for(model, "the planner").pipeline_layout(model)
    blocks = model.get_submodule(layout.layers)

    def count(paths: tuple[str, ...]) -> int:
        return sum(p.numel() for path in paths for p in model.get_submodule(path).parameters())

    first_params = {id(p) for path in layout.first for p in model.get_submodule(path).parameters()}
    # A tied head is the embedding: a pipeline's last stage holds its own copy of it.
    shared = sum(
        p.numel() for path in layout.last for p in model.get_submodule(path).parameters() if id(p) in first_params
    )
    counts = {
        "first": count(layout.first),
        "block": sum(p.numel() for p in blocks[0].parameters()),
        "block_active": active_params(model, blocks[0]),
        "last": count(layout.last),
    }
    tensors = {
        "first": sum(len(list(model.get_submodule(path).parameters())) for path in layout.first),
        "block": len(list(blocks[0].parameters())),
        "last": sum(len(list(model.get_submodule(path).parameters())) for path in layout.last),
    }
    return hidden, vocab, len(blocks), counts, shared, tensors


def _heads(config: Any) -> int:
    names = ("n_heads", "num_attention_heads", "n_head", "n_kv_heads", "num_key_value_heads")
    counts = [v for name in names if isinstance(v := getattr(config, name, None), int)]
    return math.gcd(*counts) if counts else 1


def _first_attr(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
