"""Model policies: what each model family needs for tensor, sequence and pipeline parallelism.

A policy names, for each submodule, the tensor-parallel style it gets, where the model can be
cut into pipeline stages, and how attention goes through Ulysses, and it checks the model's
sizes against the degrees. No Hugging Face modeling file is copied or patched: the styles and
hooks are applied to the model as it is.
"""

from __future__ import annotations

from torch import nn

from tessera.errors import PlanError
from tessera.models.policies.base import Policy
from tessera.models.policies.gpt2 import GPT2
from tessera.models.policies.hf_llama import HF_LLAMA
from tessera.models.policies.llama import LLAMA

POLICIES: tuple[Policy, ...] = (LLAMA, HF_LLAMA, GPT2)


def policy_for(model: nn.Module, feature: str = "tensor parallelism") -> Policy:
    """The policy for ``model``'s family, or a PlanError naming the families that have one.

    ``feature`` (what needs the policy) goes into the error, with the Plan field to reset."""
    for policy in POLICIES:
        if policy.matches(model):
            return policy
    names = ", ".join(p.name for p in POLICIES)
    raise PlanError(
        f"{feature} has no policy for {type(model).__name__}: policies exist for {names}. "
        f"Use Plan.{'pp' if 'pipeline' in feature else 'tp'}=1 (data parallelism and ZeRO work for any model)."
    )


__all__ = ["POLICIES", "Policy", "policy_for"]
