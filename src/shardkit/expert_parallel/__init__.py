"""Expert parallelism: token dispatch/combine over uneven all-to-alls and MoE plan styles.

* :mod:`.dispatch`: :func:`dispatch_plan`, :func:`token_dispatch`, :func:`token_combine`
  (Megatron-LM / torchtitan all-to-all token dispatcher, exact backward, zero-token ranks).
* :mod:`.experts`: the per-expert math of a transformers experts module on local experts, all
  of them as one grouped GEMM per projection.
* :mod:`.capacity`: expert capacity and token dropping (Megatron-LM's capacity factor).
* :mod:`.balance`: router load balancing (DeepSeek-V3's bias and sequence-wise loss, z-loss).
* :mod:`.router`: those on a transformers router (the trainer's ``--moe-*`` flags).
* :mod:`.router_capacity`: the capacity at the router, per token group of a call.
* :mod:`.hf`: ``grouped_gemm`` parameter sharding, the EP-dispatch and ``ep_router`` forwards
  and the ``moe_identity_expert`` input scaling, for transformers MoE models.
* :mod:`.styles`: those as :func:`shardkit.apply_tp` plan styles, and :func:`ep_plan`.
"""

from .balance import biased_topk, expert_load, router_z_loss, sequence_balance_loss, update_router_bias_
from .capacity import CapacityRouting, apply_capacity, expert_capacity
from .dispatch import DispatchPlan, dispatch_plan, token_combine, token_dispatch
from .experts import expert_forward, grouped_experts_forward, routed_experts_forward
from .hf import (
    ExpertShard,
    ep_experts_forward,
    expert_shard,
    identity_expert_parallel,
    install_ep_forward,
    shard_expert_param,
    shard_expert_params,
    shard_experts,
)
from .styles import EpDispatchExperts, EpRouter, GroupedGemm, ep_plan, ep_styles

__all__ = [
    "DispatchPlan",
    "dispatch_plan",
    "token_dispatch",
    "token_combine",
    "CapacityRouting",
    "apply_capacity",
    "expert_capacity",
    "biased_topk",
    "expert_load",
    "update_router_bias_",
    "sequence_balance_loss",
    "router_z_loss",
    "expert_forward",
    "grouped_experts_forward",
    "routed_experts_forward",
    "ExpertShard",
    "expert_shard",
    "shard_expert_param",
    "shard_expert_params",
    "install_ep_forward",
    "shard_experts",
    "ep_experts_forward",
    "identity_expert_parallel",
    "GroupedGemm",
    "EpDispatchExperts",
    "EpRouter",
    "ep_plan",
    "ep_styles",
]
