"""Expert-parallel plan styles for :func:`shardkit.apply_tp`, and the model's EP plan.

* ``grouped_gemm`` (on a 3-D expert parameter ``[E, ...]``): keep this rank's block of experts
  (balanced: the first ``E % R`` ranks get one more; a rank may hold none).
* ``ep_dispatch_experts`` (on the experts module, transformers >= 5): tokens are sent to their
  experts' ranks with the all-to-all dispatcher (:mod:`.dispatch`) and combined back. The tokens
  are replicated over the group (the tensor-parallel layout), so each rank dispatches only its
  balanced block of them and the outputs are all-gathered: no expert work is duplicated.
* ``ep_router`` (on the router, Hugging Face's earlier EP style): no all-to-all; every rank runs
  its own experts on all tokens and the partial outputs are summed over the group. It switches
  the sibling ``experts`` module to that mode.

Source: Hugging Face transformers' EP plans (``base_model_ep_plan``); Megatron-LM / torchtitan
all-to-all token dispatch.
"""

from __future__ import annotations

from torch import nn

from ..comm._compat import hf_ep_plan
from ..errors import ShardkitError, ShardkitTypeError
from ..tensor_parallel.plan import model_tp_plan
from ..tensor_parallel.style_base import ParallelStyle, StyleContext
from .hf import expert_shard, install_ep_forward, shard_expert_param, shard_expert_params

__all__ = ["GroupedGemm", "EpDispatchExperts", "EpRouter", "ep_styles", "ep_plan"]


def _shard_experts_or_refuse(module: nn.Module, ctx: StyleContext, style: str) -> None:
    """Cut the module's per-expert parameters; refuse a module that has none (not an experts module)."""
    if not shard_expert_params(module, ctx.group) and expert_shard(module) is None:
        raise ShardkitTypeError(
            f"{style}: {ctx.name or 'the module'} ({type(module).__name__}) has no per-expert parameters "
            "(leading dim num_experts) to shard; it takes a transformers experts module"
        )


class GroupedGemm(ParallelStyle):
    """``grouped_gemm``: shard expert parameters by their leading experts dim."""

    def shard_param(self, module: nn.Module, pname: str, ctx: StyleContext) -> None:
        shard_expert_param(module, pname, ctx.group)

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        _shard_experts_or_refuse(module, ctx, "grouped_gemm")


class EpDispatchExperts(ParallelStyle):
    """``ep_dispatch_experts``: expert-sharded experts module with all-to-all token dispatch.

    Args:
        mode: ``"dispatch"`` (all-to-all) or ``"local"`` (each rank runs its experts on all
            tokens; outputs summed).
        tokens: ``"replicated"`` (the same tokens on every rank) or ``"sharded"``.
    """

    def __init__(self, mode: str = "dispatch", tokens: str = "replicated") -> None:
        self.mode, self.tokens = mode, tokens

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        _shard_experts_or_refuse(module, ctx, "ep_dispatch_experts")  # no-op for what a grouped_gemm rule cut
        install_ep_forward(module, ctx.group, mode=self.mode, tokens=self.tokens)


class EpRouter(ParallelStyle):
    """``ep_router`` on an MoE block's router: its sibling ``experts`` run in ``"local"`` mode."""

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        parent_name = ctx.name.rsplit(".", 1)[0] if "." in ctx.name else ""
        parent = ctx.model.get_submodule(parent_name) if ctx.model is not None else None
        experts = getattr(parent, "experts", None)
        if not isinstance(experts, nn.Module):
            raise ShardkitError(f"ep_router at {ctx.name}: no sibling 'experts' module to run in expert-parallel mode")
        shard_expert_params(experts, ctx.group)
        install_ep_forward(experts, ctx.group, mode="local", tokens="replicated")


def ep_styles() -> dict[str, ParallelStyle]:
    """The expert-parallel style names for the plan table."""
    return {"grouped_gemm": GroupedGemm(), "ep_dispatch_experts": EpDispatchExperts(), "ep_router": EpRouter()}


def ep_plan(model: nn.Module) -> dict:
    """The model's tensor-parallel plan with its experts rules replaced by the config's EP plan
    (``config.base_model_ep_plan``, transformers >= 5), for ``apply_tp(model, mesh, ep_plan(model))``.

    The EP plan's expert-parallel style names (``grouped_gemm``, ``ep_router``,
    ``ep_dispatch_experts``) come as their style objects (:func:`ep_styles`), which
    :func:`~shardkit.apply_tp` takes as they are; other names stay strings.

    Raises:
        ShardkitError: the model has no EP plan.
    """
    ep = hf_ep_plan(getattr(model, "config", None))
    if not ep:
        raise ShardkitError(f"ep_plan: {type(model).__name__} has no base_model_ep_plan")
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    plan = {k: v for k, v in model_tp_plan(model).items() if ".experts" not in k}
    styles = ep_styles()
    plan.update({prefix + k: styles.get(v, v) if isinstance(v, str) else v for k, v in ep.items()})
    return plan
