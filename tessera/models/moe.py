"""A mixture-of-experts feed-forward layer for the reference Llama: token-choice top-k routing, every token
kept (dropless), a load-balance loss or the loss-free bias, an optional shared expert.

The router scores each token against every expert (softmax or sigmoid) and sends it to its ``top_k``
best; the expert outputs are added up with the scores of the experts chosen (renormalised to sum to 1
when ``normalize``). Experts are SwiGLU feed-forwards whose weights are stacked, expert first
(``w1``/``w3``: experts × dim × hidden, ``w2``: experts × hidden × dim), so expert parallelism splits
dimension 0 and a grouped matrix product can take them whole.

Balancing, two ways (either or both):

- ``aux_loss_weight``: the Switch/GShard loss ``E · Σ_e f_e · P_e`` (f_e: the share of routed slots that
  went to expert e; P_e: the mean router score of e), weighted and added to the gradient through the
  layer's output (:class:`AttachLoss`), so no caller has to collect it. Its value is kept in
  ``balance_loss``. Over data-parallel ranks the counts are summed over ``balance_group`` (set by the
  runtime), so the loss is the one of the whole batch a single process would see.
- ``bias_rate``: DeepSeek-V3's loss-free balancing: a per-expert bias added to the scores for choosing
  experts only (not to the weights), nudged after each optimizer step by ``bias_rate`` toward the
  experts that got fewer tokens than the mean (:func:`after_step`).

Example::

    layer = MoE(dim=64, hidden=128, experts=8, top_k=2)
    y = layer(torch.randn(2, 16, 64))     # same shape; layer.tokens_per_expert: the last call's counts
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tessera.errors import PlanError


@dataclass(frozen=True)
class MoESpec:
    """How a Llama's feed-forward blocks become experts (``experts=0``: dense)."""

    experts: int = 0
    top_k: int = 2
    score: Literal["softmax", "sigmoid"] = "softmax"
    normalize: bool = True  # the chosen experts' weights sum to 1
    aux_loss_weight: float = 0.01
    bias_rate: float = 0.0  # loss-free balancing: bias step per optimizer step (0: off)
    shared_expert: bool = False
    hidden: int | None = None  # each expert's hidden size (None: the dense ffn_dim)

    def __post_init__(self) -> None:
        if self.experts < 0:
            raise PlanError(f"moe.experts={self.experts} must be 0 (dense) or more.")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise PlanError(
                f"moe.top_k={self.top_k} must be between 1 and moe.experts={self.experts}: a token cannot go to "
                "more experts than there are."
            )
        if self.score not in ("softmax", "sigmoid"):
            raise PlanError(f"moe.score={self.score!r} must be 'softmax' or 'sigmoid'.")
        if self.aux_loss_weight < 0 or self.bias_rate < 0:
            raise PlanError("moe.aux_loss_weight and moe.bias_rate must be 0 or more.")


class AttachLoss(torch.autograd.Function):
    """``output`` unchanged; its backward also sends ``scale`` into ``loss``: a one-element tensor read then,
    not when the forward ran (the layer's ``loss_scale``, which the runtime sets between the two to the
    multiplier of the batch loss in that backward), so a loss computed inside a layer trains without the
    caller adding it to theirs, in every layout. A tensor read by an operator of its own
    (:func:`_read_at_backward`): a compiled block's backward is traced with its forward, and would keep a
    number as the constant it was then, or compute a value that depends on the forward's inputs alone in
    the forward (AOTAutograd's partitioner moves such work there)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        ctx.scale = scale  # not saved for backward: that would refuse the runtime's later fill_
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, _read_at_backward(ctx.scale, grad).expand(ctx.loss_shape), None


@torch.library.custom_op("tessera::read_at_backward", mutates_args=())
def _read_at_backward(value: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A copy of ``value`` as it is once ``after`` exists: an operator no compiler looks into, so a traced
    backward reads ``value`` when it runs (``after``, a tensor of that backward, fixes the order)."""
    return value.clone()


@_read_at_backward.register_fake
def _(value: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


class MoE(nn.Module):
    """Experts in place of one SwiGLU feed-forward: ``forward(x)`` keeps x's shape."""

    def __init__(self, dim: int, hidden: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        e = spec.experts
        self.router = nn.Linear(dim, e, bias=False)
        self.experts = Experts(e, dim, hidden)
        self.shared = _SwiGLU(dim, hidden) if spec.shared_expert else None
        self.register_buffer("expert_bias", torch.zeros(e))  # saved: part of the routing
        self.register_buffer("load", torch.zeros(e), persistent=False)  # routed slots since the last bias step
        self.balance_group: dist.ProcessGroup | None = None  # ranks whose tokens make one batch
        # the runtime's multiplier of the batch loss in the coming backward (:attr:`loss_scale`)
        self.register_buffer("loss_multiplier", torch.ones(()), persistent=False)
        self.tokens_per_expert = torch.zeros(e, dtype=torch.long)  # this rank's last call
        self.routed = torch.zeros(e)  # the whole batch's routed slots per expert, at the last optimizer step
        self.balance_loss = torch.zeros(())  # the whole batch's balance loss, at the last training call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores, chosen, weights = self.route(tokens)
        counts = torch.bincount(chosen.flatten(), minlength=self.spec.experts)
        out = self.experts_forward(tokens, chosen, weights, counts)
        if self.shared is not None:
            out = out + self.shared(tokens)
        self.tokens_per_expert = counts.detach()
        if self.training:  # evaluation's routing is not the step's (nor the bias's business)
            self.load += counts.detach().to(self.load.dtype)
        if self.spec.aux_loss_weight and self.training and torch.is_grad_enabled():
            loss = self.balance(scores, counts)
            out = AttachLoss.apply(out, loss * self.spec.aux_loss_weight, self.loss_multiplier)
        return out.reshape(x.shape)

    @property
    def loss_scale(self) -> float:
        """What the coming backward multiplies this layer's balance loss by (the batch loss's multiplier)."""
        return float(self.loss_multiplier)

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_multiplier.fill_(value)  # in place: a backward already traced reads it when it runs

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every expert's score of each token (tokens × experts), the ``top_k`` chosen, and their weights."""
        logits = self.router(tokens).float()
        scores = logits.softmax(-1) if self.spec.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores.detach() + self.expert_bias, self.spec.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.spec.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, chosen, weights.type_as(tokens)

    def experts_forward(
        self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Each token through its chosen experts, weighted and added (:func:`dispatch`)."""
        experts = self.experts
        return dispatch(
            tokens, chosen, weights, experts, self.spec.experts, experts.ep_group, counts, experts.ep_shares
        )

    def balance(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """E · Σ_e f_e · P_e: 1 when balanced. f counts the routing of the whole batch (summed over
        ``balance_group``); P is this rank's mean score, so the gradients averaged over the data ranks are the
        whole batch's. ``balance_loss`` keeps the whole batch's value (P summed over the ranks too)."""
        e = self.spec.experts
        batch = torch.cat([counts.detach().float(), scores.detach().sum(0), scores.new_tensor([len(scores)])])
        if self.balance_group is not None and dist.get_world_size(self.balance_group) > 1:
            dist.all_reduce(batch, group=self.balance_group)
        share = batch[:e] / batch[:e].sum()
        self.balance_loss = e * (share * batch[e : 2 * e] / batch[-1]).sum()
        return e * (share * scores.mean(0)).sum()


def dispatch(
    tokens: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    counts: torch.Tensor | None = None,
    shares: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Each token (row of ``tokens``) through its ``chosen`` experts (tokens × top_k), weighted by ``weights``
    and added: slots sorted by expert, every expert's rows through ``experts(rows, counts)`` (on this rank, or
    with expert parallelism over ``group`` on their owners, ``shares[r]`` experts on rank r or an even split:
    :func:`exchange`), every token kept."""
    if counts is None:
        counts = torch.bincount(chosen.flatten(), minlength=num_experts)
    top_k = chosen.shape[-1]
    order = torch.argsort(chosen.flatten(), stable=True)
    owner = order // top_k  # the token of each sorted slot
    sent = tokens[owner]
    done = experts(sent, counts) if group is None else exchange(sent, counts, experts, num_experts, group, shares)
    return torch.zeros_like(tokens).index_add(0, owner, done * weights.flatten()[order, None].to(done.dtype))


def exchange(
    sent: torch.Tensor,
    counts: torch.Tensor,
    experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_experts: int,
    group: dist.ProcessGroup,
    shares: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Expert parallelism: slots sorted by expert go to the ranks owning their experts (all-to-all of the
    counts, then of the rows, splits uneven), through the experts there, and back in the same order. Rank r
    owns the ``shares[r]`` experts after those of the ranks before it (``shares``: None, an even split)."""
    ep = dist.get_world_size(group)
    owned = list(shares) if shares is not None else [num_experts // ep] * ep
    mine = owned[dist.get_rank(group)]
    from_each = counts.new_empty(ep * mine)  # from_each[r·mine + j]: rows rank r sends to my expert j
    dist.all_to_all_single(from_each, counts, [mine] * ep, owned, group=group)
    send = [int(part.sum()) for part in torch.split(counts, owned)]
    grid = from_each.view(ep, mine)
    recv = grid.sum(1).tolist()
    got = funcol.wait_tensor(funcol.all_to_all_single_autograd(sent.contiguous(), recv, send, group))
    # got: by source rank, each source's rows by expert; the experts want them by expert, then source
    starts = torch.cumsum(grid.flatten(), 0) - grid.flatten()  # where (source, expert) begins in got
    by_expert = torch.cat(
        [
            torch.arange(int(starts[r * mine + j]), int(starts[r * mine + j] + grid[r, j]))
            for j in range(mine)
            for r in range(ep)
        ]
    ).to(got.device)
    done = experts(got[by_expert], grid.sum(0))
    back = torch.zeros_like(got).index_copy(0, by_expert, done)
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(back, send, recv, group))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` on its way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale if ctx.scale != 1.0 else grad, None


class Experts(nn.Module):
    """SwiGLU experts with stacked weights, expert first (``w1``/``w3``: experts × dim × hidden, ``w2``:
    experts × hidden × dim). A module of their own, so expert parallelism and ZeRO can lay them out apart
    from the rest of the layer."""

    stacked_weights = ("w1", "w3", "w2")  # what expert parallelism splits on dimension 0

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.ep_group: dist.ProcessGroup | None = None  # expert parallelism: the ranks sharing the experts
        self.ep_shares: tuple[int, ...] | None = None  # experts held by each of them (None: an even split)
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.grad_scale = 1.0  # what the weights' gradients are multiplied by (expert parallelism under ZeRO)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows`` grouped by this rank's experts (``counts`` rows each, in order) through them."""
        w1, w3, w2 = (scale_grad(w, self.grad_scale) for w in (self.w1, self.w3, self.w2))
        return grouped_matmul(F.silu(grouped_matmul(rows, w1, counts)) * grouped_matmul(rows, w3, counts), w2, counts)


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def scale_grad(weight: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight`` as this rank holds it (its experts under expert parallelism), its gradient times ``scale``."""
    return _ScaleGrad.apply(_local(weight), scale)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight (a DTensor split over the expert-parallel ranks, or whole)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows`` grouped by expert (``counts[e]`` rows for expert e, in order) times each one's matrix
    (``weights[e]``: in × out): torch's grouped GEMM (one kernel for every expert) where it runs, a loop of
    products elsewhere. Both give the same values and gradients (tests/test_moe.py). Under ``torch.compile``
    it is one opaque operator of the compiled graph (:func:`_compiled_grouped_matmul`)."""
    if torch.compiler.is_compiling():
        return torch.ops.tessera.grouped_matmul(rows, weights, counts)
    return _eager_grouped_matmul(rows, weights, counts)


def _eager_grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if can_group(rows, weights):
        return F.grouped_mm(rows, weights, offs=_offsets(counts, rows.device))
    out, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        out.append(rows[start : start + count] @ weights[expert])
        start += count
    return torch.cat(out) if out else rows.new_zeros(0, weights.shape[-1])


def _offsets(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where each expert's rows end: what F.grouped_mm takes as ``offs``."""
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


# Compiled blocks with experts: each expert's row count is known only at run time, and torch 2.13 traces
# F.grouped_mm in bf16 only (its meta function), so inside a compiled block the grouped GEMM is an operator of
# its own, run by its eager kernel: the graph keeps static shapes (rows in, rows out) around it, and no step
# recompiles when the routing changes.
@torch.library.custom_op("tessera::grouped_matmul", mutates_args=())
def _compiled_grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return _eager_grouped_matmul(rows, weights, counts)


@_compiled_grouped_matmul.register_fake
def _(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weights.shape[-1])


@torch.library.custom_op("tessera::grouped_weight_grad", mutates_args=())
def _grouped_weight_grad(rows: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's weight gradient (experts × in × out): its rows transposed times its rows' gradients."""
    if can_group(rows, grad):  # one kernel, grouped over the rows (torch's own backward of F.grouped_mm)
        return F.grouped_mm(rows.t(), grad, offs=_offsets(counts, rows.device))
    out, start = rows.new_zeros(len(counts), rows.shape[-1], grad.shape[-1]), 0
    for expert, count in enumerate(counts.tolist()):
        out[expert] = rows[start : start + count].T @ grad[start : start + count]
        start += count
    return out


@_grouped_weight_grad.register_fake
def _(rows: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(counts.shape[0], rows.shape[-1], grad.shape[-1])


def _grouped_setup(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    rows, weights, counts = ctx.saved_tensors
    grad = grad.contiguous()
    return (
        _compiled_grouped_matmul(grad, weights.transpose(-2, -1).contiguous(), counts),
        _grouped_weight_grad(rows, grad, counts),
        None,
    )


_compiled_grouped_matmul.register_autograd(_grouped_backward, setup_context=_grouped_setup)


def can_group(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands: torch ≥ 2.10 has ``F.grouped_mm``, with a CPU kernel
    and a CUDA one from compute capability 8.0; its rows must be 16-byte aligned (fp32: sizes that are
    multiples of 4; bf16: of 8) and both operands of one dtype."""
    if not GROUPED or not hasattr(F, "grouped_mm") or rows.dtype != weights.dtype:
        return False
    if rows.device.type == "cuda":
        if torch.cuda.get_device_capability(rows.device) < (8, 0):
            return False
    elif rows.device.type != "cpu":
        return False
    size = rows.element_size()
    return all((n * size) % 16 == 0 for n in (rows.shape[-1], weights.shape[-1], weights.shape[-2]))


GROUPED = True  # False: always the loop (tests compare the two)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def after_step(model: nn.Module) -> None:
    """After an optimizer step, for each layer: ``routed``, the slots each expert took in the step's whole
    batch (counts summed over ``balance_group``); with ``bias_rate``, the loss-free bias moved that much up
    for experts that took fewer than the mean, down for those that took more (every rank alike)."""
    for layer in moe_layers(model):
        load = layer.load.clone()
        if layer.balance_group is not None and dist.get_world_size(layer.balance_group) > 1:
            dist.all_reduce(load, group=layer.balance_group)
        layer.routed = load.cpu()
        if layer.spec.bias_rate:
            layer.expert_bias += layer.spec.bias_rate * torch.sign(load.mean() - load)
        layer.load.zero_()
