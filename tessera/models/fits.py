"""Whether a Plan's tensor, sequence, expert and pipeline degrees fit a model's shapes, checked before launch.

The launcher builds the model on the meta device (shapes, no memory) and asks its family's policy the
questions the runtime asks when it lays the model out (:mod:`tessera.runtime.parallelize`,
:mod:`tessera.runtime.pipelined`): the sizes tp must divide, whether the family has a split/gather,
Ulysses or pipeline layout, the attention heads sp must divide, whether it has experts Tessera splits, and
the layers the stages take. A plan the model cannot take is refused in a second, not after its ranks have
started. The experts' count against Plan.ep is checked from the config alone (:mod:`tessera.launch.preflight`).

Example::

    with torch.device("meta"):
        model = build_model(cfg)
    check_plan_fits(model, plan, seq_len=cfg.data.seq_len)   # PlanError naming the field and the fix
"""

from __future__ import annotations

from torch import nn

from tessera.errors import PlanError
from tessera.models.hf_experts import HF_EXPERTS, expert_modules
from tessera.models.policies import policy_for
from tessera.parallel.replicas import check_replica_tp
from tessera.parallel.sequence import check_ulysses_heads
from tessera.plan import Plan

HEADS = ("num_attention_heads", "n_heads", "n_head")  # what the families' policies call the attention heads
SPLIT_EXPERTS = "the reference Llama's model.moe and Hugging Face " + ", ".join(HF_EXPERTS)


def check_plan_fits(model: nn.Module, plan: Plan, seq_len: int) -> None:
    """Refuse (PlanError) a plan whose tp, sp, ep or pp the model's shapes cannot take."""
    split_gather = plan.sp > 1 and plan.sp_mode == "split_gather"
    if plan.tp > 1:
        policy = policy_for(model, "tensor parallelism")
        policy.check_tp(model, plan.tp)
        if split_gather:
            policy.tensor_plan(model, sequence_parallel=True)  # refuses a family without a split/gather plan
            _check_sequence(seq_len, plan.tp, "Plan.sp (split/gather, over the tp ranks)")
    if any(r.tp > 1 for r in plan.replicas or ()):  # a replica's own tp, as the replicas engine checks it
        check_replica_tp(policy_for(model, "tensor parallelism"), model, plan)
    if plan.ulysses_size > 1:
        policy = policy_for(model, "Ulysses sequence parallelism")
        if policy.ulysses is None:
            raise PlanError(
                f"Ulysses sequence parallelism (Plan.sp > 1) has no hook for {policy.name} yet: use Plan.sp=1."
            )
        sizes = policy.sizes(model)
        heads = next((sizes[name] for name in HEADS if name in sizes), None)
        if heads is not None:
            check_ulysses_heads(heads, plan.sp)
        _check_sequence(seq_len, plan.sp, "Plan.sp")
    if plan.ep > 1 and not expert_modules(model):
        raise PlanError(
            f"Plan.ep={plan.ep} splits experts, but {type(model).__name__} has no experts Tessera can split: expert "
            f"parallelism takes {SPLIT_EXPERTS}. Use Plan.ep=1 (each rank then runs every expert)."
        )
    if plan.pp > 1 and plan.replicas is None:
        layout = policy_for(model, "pipeline parallelism").pipeline_layout(model)
        plan.pipeline.stage_ranges(len(model.get_submodule(layout.layers)), plan.pp)


def _check_sequence(seq_len: int, parts: int, field: str) -> None:
    if seq_len % parts:
        raise PlanError(
            f"data.seq_len={seq_len} does not divide by {field}={parts}: each rank takes an equal slice of every "
            f"sequence; use a data.seq_len that is a multiple of {parts}."
        )
