"""Stage-local tensor parallelism for a :class:`~.hf_llama.LlamaStageModule` (Megatron TP).

Plain Megatron-LM TP inside a stage, so hidden states between blocks, and at the stage
boundaries, are replicated over the stage's tp group (boundary layout
:class:`~.vtp.Replicate`, gradient convention "replicated": every rank ends with the full input
gradient). Per decoder layer (``t`` = the stage's tp size):

* ``self_attn``: a pre-hook applies ``f`` once (:func:`shardkit.comm.all_reduce_backward`:
  identity forward, all-reduce of the partial input gradients backward; the colwise styles'
  own ``f`` is turned off so q, k and v share one); ``q_proj`` colwise by query heads,
  ``k_proj``/``v_proj`` colwise by key/value heads (whole heads per rank), ``o_proj`` rowwise
  with ``g`` (all-reduce forward, identity backward).
* ``mlp``: ``f``; ``gate_proj``/``up_proj`` colwise, ``down_proj`` rowwise with ``g``.
* the RMSNorms, the embedding (first stage) and the final norm (last stage) stay replicated:
  they run on replicated activations whose gradient is complete on every rank after ``f``, so
  their parameter gradients are complete and identical on every rank (no reduction needed).
* ``lm_head`` (last stage): colwise over the vocabulary with ``f`` and a vocab all-gather of
  the logits (``colwise_gather_output``), so the loss sees full ``[B, S, V]`` logits on every
  rank, as in :func:`shardkit.tensor_parallel.apply_llama_tp`.

Source: Megatron-LM tensor parallelism (Shoeybi et al., 2019), applied per pipeline stage; the
stage's tp size may differ from its neighbours' (MindSpeed-MM VTP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .._shapes import balanced_split_sizes
from ..comm import all_reduce_backward
from ..comm._group import resolve_group
from ..errors import ShardkitError
from ..tensor_parallel.styles import ColwiseParallel, RowwiseParallel

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["apply_llama_stage_tp", "check_llama_stage_tp"]


def check_llama_stage_tp(config, tp: int) -> None:
    """Check that ``tp`` ranks can split a Llama stage (pure).

    Raises:
        ShardkitError: ``tp`` does not divide the query or key/value heads.
    """
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    if tp > 1 and (n_q % tp or n_kv % tp):
        raise ShardkitError(f"apply_llama_stage_tp: tp={tp} must divide num_attention_heads={n_q} and "
                            f"num_key_value_heads={n_kv} (whole heads per rank)")


def _f_pre_hook(group):
    def hook(module, args, kwargs):
        if args:
            return (all_reduce_backward(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": all_reduce_backward(kwargs["hidden_states"], group)}
    return hook


def apply_llama_stage_tp(stage_module: nn.Module, tp_group: Group) -> nn.Module:
    """Shard a :class:`~.hf_llama.LlamaStageModule` over its stage's tp group, in place.

    Every rank of the group must call it on a stage holding the same full weights. Forward
    contract unchanged: replicated ``[B, S, H]`` (or input ids) in, replicated hidden states (or
    full logits ``[B, S, V]``) out, identical on every rank.

    Args:
        stage_module: a :class:`~.hf_llama.LlamaStageModule`.
        tp_group: the stage's tp ``ProcessGroup`` or 1-D ``DeviceMesh`` (``t`` ranks).

    Returns:
        ``stage_module``; unchanged when ``t == 1``.

    Raises:
        ShardkitError: see :func:`check_llama_stage_tp`.
    """
    g = resolve_group(tp_group, "apply_llama_stage_tp")
    if g.size == 1:
        return stage_module
    config = stage_module.config
    check_llama_stage_tp(config, g.size)
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    q_sizes = [h * head_dim for h in balanced_split_sizes(n_q, g.size)]
    kv_sizes = [h * head_dim for h in balanced_split_sizes(n_kv, g.size)]
    ff_sizes = balanced_split_sizes(config.intermediate_size, g.size)
    for layer in stage_module.model.layers.values():
        attn, mlp = layer.self_attn, layer.mlp
        for proj, sizes in ((attn.q_proj, q_sizes), (attn.k_proj, kv_sizes), (attn.v_proj, kv_sizes)):
            ColwiseParallel(sizes, reduce_input_grad=False).apply(proj, tp_group)
        RowwiseParallel(q_sizes).apply(attn.o_proj, tp_group)
        attn.register_forward_pre_hook(_f_pre_hook(tp_group), with_kwargs=True)
        for proj in (mlp.gate_proj, mlp.up_proj):
            ColwiseParallel(ff_sizes, reduce_input_grad=False).apply(proj, tp_group)
        RowwiseParallel(ff_sizes).apply(mlp.down_proj, tp_group)
        mlp.register_forward_pre_hook(_f_pre_hook(tp_group), with_kwargs=True)
    if stage_module.is_last:
        lm_head = stage_module.lm_head
        vocab_sizes = balanced_split_sizes(lm_head.out_features, g.size)
        ColwiseParallel(vocab_sizes, gather_output=True).apply(lm_head, tp_group)
    return stage_module
