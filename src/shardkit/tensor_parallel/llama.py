"""Tensor + sequence parallelism for Hugging Face Llama-architecture causal LMs, from outside.

The plan, per decoder layer (``R`` = tp ranks, hidden states ``[B, S_r, H]`` between blocks):

* ``self_attn``: pre-hook all-gathers the sequence; ``q_proj`` colwise by query heads,
  ``k_proj``/``v_proj`` colwise by key/value heads (whole heads per rank, so attention runs on
  local heads unchanged: HF reshapes with ``-1`` heads and ``num_key_value_groups`` is a ratio);
  ``o_proj`` rowwise with a reduce-scatter along the sequence.
* ``mlp``: pre-hook all-gathers; ``gate_proj``/``up_proj`` colwise, ``down_proj`` rowwise with a
  reduce-scatter along the sequence.
* ``input_layernorm``/``post_attention_layernorm`` run on the local block with a replicated
  weight whose gradient is summed over tp (:func:`.styles.sum_grad_over`).

Around the layers: the sequence is split at a pre-hook on ``layers[0]``, not at the embedding,
because ``LlamaModel`` derives the causal mask and position ids from the embedding output's
length. The embedding stays replicated; the split's backward all-gathers its gradient, so it is
identical and complete on every tp rank. The final norm is like the layer norms; ``lm_head`` is
colwise over the vocab between a sequence all-gather and a vocab all-gather of the logits, so the
HF loss sees full ``[B, S, V]`` logits, identical on every tp rank.

Source: Megatron-LM tensor parallelism (Shoeybi et al., 2019) with sequence parallelism
(Korthikanti et al., 2022); the plan strings follow transformers' ``base_model_tp_plan``.
"""

from __future__ import annotations

from torch import nn

from .._shapes import balanced_split_sizes
from ..comm import gather_forward_split_backward
from ..comm._group import resolve_group
from ..errors import ShardkitError, ShardkitTypeError
from .sequence import SequenceSharding
from .styles import ColwiseParallel, RowwiseParallel, sum_grad_over

__all__ = ["apply_llama_tp", "check_llama_tp"]


def _heads(config) -> tuple[int, int, int]:
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
    return n_q, n_kv, head_dim


def check_llama_tp(config, tp: int) -> None:
    """Check that a Llama config can be split over ``tp`` ranks (pure: no process group).

    Any ``tp`` passes when ``tp == 1`` (the model is left unchanged).

    Raises:
        ShardkitError: ``num_attention_heads`` or ``num_key_value_heads`` is not divisible by
            ``tp``, or the word embeddings are tied to ``lm_head``.
    """
    if tp == 1:
        return  # nothing is split
    n_q, n_kv, _ = _heads(config)
    if n_q % tp or n_kv % tp:
        raise ShardkitError(
            f"apply_llama_tp: tp={tp} must divide num_attention_heads={n_q} and num_key_value_heads={n_kv} "
            "(whole query and key/value heads per rank)"
        )
    if getattr(config, "tie_word_embeddings", False):
        raise ShardkitError(
            "apply_llama_tp: tie_word_embeddings=True is not supported (lm_head is vocab-sharded while the "
            "embedding stays replicated); build the model with tie_word_embeddings=False"
        )


def _head_sizes(n_heads: int, head_dim: int, tp: int) -> list[int]:
    return [h * head_dim for h in balanced_split_sizes(n_heads, tp)]


def apply_llama_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Apply tensor + sequence parallelism to a ``LlamaForCausalLM``-shaped model in place.

    Every rank of the tp group must call it on a model holding the same full weights (e.g.
    built from the same seed); afterwards each rank holds its shards. The forward contract is
    the unsharded model's: ``model(input_ids [B, S], labels=...)`` gives logits ``[B, S, V]``
    and loss identical on every tp rank (full-sequence training forward; no KV cache, no
    ``logits_to_keep``). Hidden states returned with ``output_hidden_states`` are the local
    sequence blocks ``[B, S_r, H]``.

    Args:
        model: a causal LM with ``model.model.embed_tokens``, ``model.model.layers`` (each with
            ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
            ``post_attention_layernorm``), ``model.model.norm`` and ``model.lm_head``.
        tp_mesh: the tp ``ProcessGroup`` or 1-D ``DeviceMesh`` (e.g. ``mesh["tp"]``).

    Returns:
        ``model`` (the same object); unchanged when the group has one rank.

    Raises:
        ShardkitError: see :func:`check_llama_tp`.
        ShardkitTypeError: the model does not have the Llama module layout.
    """
    g = resolve_group(tp_mesh, "apply_llama_tp")
    if g.size == 1:
        return model
    config = model.config
    check_llama_tp(config, g.size)
    try:
        base, lm_head, layers = model.model, model.lm_head, model.model.layers
    except AttributeError as e:
        raise ShardkitTypeError(f"apply_llama_tp: expected a LlamaForCausalLM-shaped model: {e}") from e
    if lm_head.weight is base.embed_tokens.weight:
        raise ShardkitError("apply_llama_tp: lm_head.weight is the embedding weight (tied); untie it first")

    n_q, n_kv, head_dim = _heads(config)
    q_sizes = _head_sizes(n_q, head_dim, g.size)
    kv_sizes = _head_sizes(n_kv, head_dim, g.size)
    ff_sizes = balanced_split_sizes(config.intermediate_size, g.size)
    vocab_sizes = balanced_split_sizes(lm_head.out_features, g.size)
    seq = SequenceSharding(tp_mesh, dim=1)

    layers[0].register_forward_pre_hook(seq.split_pre_hook, with_kwargs=True)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        ColwiseParallel(q_sizes, reduce_input_grad=False).apply(attn.q_proj, tp_mesh)
        ColwiseParallel(kv_sizes, reduce_input_grad=False).apply(attn.k_proj, tp_mesh)
        ColwiseParallel(kv_sizes, reduce_input_grad=False).apply(attn.v_proj, tp_mesh)
        RowwiseParallel(q_sizes, reduce=seq.reduce_scatter).apply(attn.o_proj, tp_mesh)
        attn.register_forward_pre_hook(seq.gather_pre_hook, with_kwargs=True)
        ColwiseParallel(ff_sizes, reduce_input_grad=False).apply(mlp.gate_proj, tp_mesh)
        ColwiseParallel(ff_sizes, reduce_input_grad=False).apply(mlp.up_proj, tp_mesh)
        RowwiseParallel(ff_sizes, reduce=seq.reduce_scatter).apply(mlp.down_proj, tp_mesh)
        mlp.register_forward_pre_hook(seq.gather_pre_hook, with_kwargs=True)
        sum_grad_over(layer.input_layernorm.weight, tp_mesh)
        sum_grad_over(layer.post_attention_layernorm.weight, tp_mesh)
    sum_grad_over(base.norm.weight, tp_mesh)

    lm_head.register_forward_pre_hook(seq.gather_pre_hook, with_kwargs=True)
    ColwiseParallel(vocab_sizes, reduce_input_grad=False).apply(lm_head, tp_mesh)
    # The loss downstream is computed identically on every tp rank and counted once, so the
    # logits' gradient is replicated and keeping this rank's vocab block of it is exact.
    lm_head.register_forward_hook(
        lambda module, args, out: gather_forward_split_backward(out, tp_mesh, -1, vocab_sizes)
    )
    return model
