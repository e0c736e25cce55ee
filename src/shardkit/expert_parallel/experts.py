"""Run a Hugging Face experts module's own math on this rank's experts.

Hugging Face (transformers >= 5) stores the experts of a MoE layer as 3-D parameters of one
module decorated with ``@use_experts_implementation``: ``gate_up_proj [E, 2I, H]`` (or
``up_proj [E, I, H]`` when ``has_gate=False``), ``down_proj [E, H, I]``, optional ``*_bias
[E, ...]``, transposed layouts (``is_transposed``: ``[E, H, 2I]`` / ``[E, I, H]``), a gating
function ``_apply_gate`` (default: ``act_fn(gate) * up`` on the concatenated halves; models with
an interleaved layout or clamped activations override it) and an optional
``post_expert_norm``. The functions here apply exactly that per-expert math on rows already
grouped by expert, so a sharded module needs no HF forward: :func:`expert_forward` one expert,
:func:`grouped_experts_forward` all local experts as one GEMM per projection
(``torch._grouped_mm`` where the build runs it, else a zero-padded ``torch.bmm``).

Every local expert takes part even with zero rows, so its parameters always get a (zero)
gradient instead of ``None``: data-parallel reducers then see the same parameters on every rank.
"""

from __future__ import annotations

from torch import nn

from .._experts import expert_forward, grouped_experts_forward, routed_experts_forward

__all__ = ["expert_forward", "grouped_experts_forward", "routed_experts_forward", "expert_param_names"]


def expert_param_names(module: nn.Module) -> list[str]:
    """Names of the module's own per-expert parameters: leading dim = ``module.num_experts``."""
    n = getattr(module, "num_experts", None)
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == n]
