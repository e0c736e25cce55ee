"""Styles for modules whose parameters stay replicated but whose gradients or activations need care.

* ``replicated_with_grad_allreduce``: parameters used on local data only (Qwen3's ``q_norm`` /
  ``k_norm`` over this rank's heads): their gradient is summed over the group.
* ``sequence_parallel``: the module (a norm, dropout) runs on this rank's block of the sequence,
  ``[B, S_r, H]`` in, ``[B, S_r, H]`` out, as PyTorch DTensor's ``SequenceParallel`` means it;
  replicated parameters get the gradient sum. (The plan that places the sequence all-gathers and
  reduce-scatters around the tensor-parallel regions is ``apply_tp(..., sequence_parallel=True)``.)
* ``mla_kv_a_proj``: DeepSeek-V2/V3 multi-head latent attention. The replicated
  ``kv_a_proj_with_mqa`` output is ``[kv_pass | k_rope]``; ``kv_pass`` goes through the
  column-parallel ``kv_b_proj`` (whose ``f`` sums its input gradient), but ``k_rope`` goes
  straight into attention over this rank's heads, so its gradient is partial: Megatron's ``f``
  (all-reduce in backward) is applied to the rope part only.

Source: Hugging Face transformers' plan strings of the same names; Megatron-LM's conjugate
``f``/``g`` operators (Shoeybi et al., 2019); DeepSeek-V2 (DeepSeek-AI, 2024) for MLA.
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm import all_reduce_backward
from ..errors import ShardkitError
from .style_base import ParallelStyle, StyleContext, sum_grad_over

__all__ = ["ReplicatedWithGradAllReduce", "SequenceParallel", "MlaKvAProjParallel"]


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Keep the module's parameters replicated; sum their gradients over the group."""

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        for p in module.parameters():
            if p.requires_grad:
                sum_grad_over(p, ctx.group)

    def shard_param(self, module: nn.Module, pname: str, ctx: StyleContext) -> None:
        p = getattr(module, pname)
        if p.requires_grad:
            sum_grad_over(p, ctx.group)


class SequenceParallel(ReplicatedWithGradAllReduce):
    """The module runs on this rank's sequence block; replicated parameters' gradients are summed."""


class MlaKvAProjParallel(ParallelStyle):
    """``kv_a_proj_with_mqa`` of MLA: replicated weight; ``f`` on the rope part of its output.

    Output ``[..., kv_lora_rank + qk_rope_head_dim]``; the last ``qk_rope_head_dim`` features
    (read from the model config) get the all-reduce-in-backward.

    Raises:
        ShardkitError: the model config has no ``qk_rope_head_dim``.
    """

    def apply_module(self, module: nn.Module, ctx: StyleContext) -> None:
        rope = getattr(getattr(ctx.model, "config", None), "qk_rope_head_dim", None)
        if not isinstance(rope, int):
            raise ShardkitError(f"mla_kv_a_proj at {ctx.name}: the model config has no qk_rope_head_dim")
        group = ctx.group

        def hook(m, args, out: torch.Tensor) -> torch.Tensor:
            kv_pass, k_rope = out.split([out.shape[-1] - rope, rope], dim=-1)
            return torch.cat([kv_pass, all_reduce_backward(k_rope, group)], dim=-1)

        module.register_forward_hook(hook)
