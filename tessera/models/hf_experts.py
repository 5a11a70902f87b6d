"""Hugging Face's stacked experts (Mixtral, Qwen2-MoE, Qwen3-MoE in transformers 5), seen by Tessera.

transformers 5 keeps each MoE block's experts as two stacked weights, expert first: ``gate_up_proj``
(experts × 2·intermediate × hidden) and ``down_proj`` (experts × hidden × intermediate), and calls
``experts(hidden_states, top_k_index, top_k_weights)`` after its router. That is the layout expert
parallelism splits, so these modules get the same treatment as the reference Llama's
:class:`~tessera.models.moe.Experts`: split on the expert dimension, and under expert parallelism
their forward goes through Tessera's :func:`~tessera.models.moe.dispatch` (all-to-all to the experts'
ranks), computing what Hugging Face's eager forward computes.

Also here, because both kinds of experts are known here (``parallel/`` never imports the models):
:func:`expert_modules` finds every stacked-experts module of a model, :func:`top_k_of` and
:func:`active_params` tell the planner how many experts a token goes through.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from tessera.models.moe import Experts, dispatch, grouped_matmul, scale_grad

#: experts classes whose forward is ``act(x·gate) * (x·up)`` then ``·down``, with those stacked weights
HF_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")
HF_WEIGHTS = ("gate_up_proj", "down_proj")


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` is one of :data:`HF_EXPERTS` (also once FSDP or replicate subclassed it)."""
    return any(cls.__name__ in HF_EXPERTS for cls in type(module).__mro__)


def through_dispatch(module: nn.Module) -> None:
    """Give ``module`` what Tessera's expert machinery reads (``stacked_weights``, ``ep_group``,
    ``grad_scale``) and a forward that goes through :func:`~tessera.models.moe.dispatch` once expert
    parallelism set ``ep_group``, a layout set ``grad_scale`` or in a compiled block (transformers' own
    forward otherwise)."""
    if hasattr(module, "stacked_weights"):
        return
    module.stacked_weights = HF_WEIGHTS
    module.ep_group = None
    module.ep_shares = None
    module.grad_scale = 1.0
    module.own_forward = module.forward
    module.rows_through = types.MethodType(_rows_through, module)
    module.forward = types.MethodType(_forward, module)


def _forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    # transformers' forward loops over the experts that got tokens (a count known at run time: no graph)
    if self.ep_group is None and self.grad_scale == 1.0 and not torch.compiler.is_compiling():
        return self.own_forward(hidden_states, top_k_index, top_k_weights)
    experts = self.rows_through
    return dispatch(
        hidden_states, top_k_index, top_k_weights, experts, self.num_experts, self.ep_group, None, self.ep_shares
    )


def _rows_through(self: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows grouped by this rank's experts (``counts`` each) through them: Hugging Face's expert formula."""
    gate_up = scale_grad(self.gate_up_proj, self.grad_scale).transpose(-2, -1)  # experts × hidden × 2·inter
    down = scale_grad(self.down_proj, self.grad_scale).transpose(-2, -1)  # experts × inter × hidden
    gate, up = grouped_matmul(rows, gate_up, counts).chunk(2, dim=-1)
    return grouped_matmul(self.act_fn(gate) * up, down, counts)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` holding stacked expert weights, ready for Tessera's expert parallelism
    (``stacked_weights``, ``num_experts``, ``ep_group``, ``grad_scale``): the reference Llama's
    :class:`~tessera.models.moe.Experts` and Hugging Face's (:data:`HF_EXPERTS`)."""
    found = []
    for module in model.modules():
        if is_hf_experts(module):
            through_dispatch(module)
            found.append(module)
        elif isinstance(module, Experts):
            found.append(module)
    return found


def top_k_of(model: nn.Module) -> int:
    """How many experts each token takes (the reference Llama's MoESpec, or a Hugging Face config)."""
    config = getattr(model, "config", None)
    moe = getattr(config, "moe", None)
    return moe.top_k if moe is not None else config.num_experts_per_tok


def active_params(model: nn.Module, block: nn.Module) -> int:
    """The parameters of ``block`` one token goes through: all but the experts it is not routed to."""
    total = sum(p.numel() for p in block.parameters())
    for unit in expert_modules(block):
        held = sum(getattr(unit, name).numel() for name in unit.stacked_weights)
        total -= held * (unit.num_experts - top_k_of(model)) // unit.num_experts
    return total
