"""Model policies: what each model family needs for tensor, sequence and pipeline parallelism.

A policy names, for each submodule, the tensor-parallel style it gets, where the model can be
cut into pipeline stages, and how attention goes through Ulysses, and it checks the model's
sizes against the degrees. No Hugging Face modeling file is copied or patched: the styles and
hooks are applied to the model as it is.
"""

from __future__ import annotations

from torch import nn

from tessera.errors import PlanError
from tessera.models.policies.gpt2 import GPT2
from tessera.models.policies.hf_llama import HF_LLAMA
from tessera.models.policies.hf_moe import HF_MOE
from tessera.models.policies.llama import LLAMA
from tessera.models.policies.through_peft import peft_base, through_peft
from tessera.parallel.policy import Policy

POLICIES: tuple[Policy, ...] = (LLAMA, HF_LLAMA, HF_MOE, GPT2)


def find_policy(model: nn.Module) -> Policy | None:
    """The policy for ``model``'s family, or None (data parallelism and ZeRO need none). A peft model
    (LoRA adapters) gets its base model's policy, seen through peft's wrapping."""
    base = peft_base(model)
    if base is not None:
        policy = find_policy(base)
        return None if policy is None else through_peft(policy)
    return next((policy for policy in POLICIES if policy.matches(model)), None)


def policy_for(model: nn.Module, feature: str = "tensor parallelism") -> Policy:
    """The policy for ``model``'s family, or a PlanError naming the families that have one.

    ``feature`` (what needs the policy) goes into the error, with the Plan field to reset."""
    policy = find_policy(model)
    if policy is not None:
        return policy
    raise missing_policy(model, feature)


def missing_policy(model: nn.Module, feature: str) -> PlanError:
    """The error for a ``feature`` that needs a policy ``model``'s family does not have."""
    names = ", ".join(p.name for p in POLICIES)
    base = peft_base(model)
    family = type(model if base is None else base).__name__ + ("" if base is None else " (under LoRA adapters)")
    return PlanError(
        f"{feature} has no policy for {family}: policies exist for {names}. "
        f"Use Plan.{_field(feature)}=1 (data parallelism and ZeRO work for any model)."
    )


def _field(feature: str) -> str:
    return "pp" if "pipeline" in feature else "sp" if "sequence" in feature else "tp"


__all__ = ["POLICIES", "Policy", "find_policy", "missing_policy", "policy_for"]
