"""Pure pre-launch checks of a model config against a tp size (no process group, no weights).

A launcher calls :func:`check_tp` before any rank builds or loads the model, so a layout
:func:`shardkit.apply_tp` would refuse is refused once, up front, instead of after the model has
loaded on every rank.
"""

from __future__ import annotations

from ..errors import ShardkitError

__all__ = ["check_tp"]


def check_tp(config, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise the error :func:`shardkit.apply_tp` would raise for this config at ``tp`` ranks.

    Args:
        config: a Hugging Face decoder config (``num_attention_heads``, optional
            ``num_key_value_heads``, ``num_experts`` / ``n_routed_experts``, ``kv_lora_rank``).
        tp: the tp size ``R``; ``tp == 1`` always passes (nothing is split).
        sequence_parallel: the sequence-parallel plan is wanted.

    Raises:
        ShardkitError: fewer query heads than ``tp`` (whole heads per rank), query heads not a
            multiple of the KV heads, or ``sequence_parallel`` with MoE layers or MLA (see
            :mod:`.sp_plan`). Head counts ``tp`` does not divide are fine (balanced query heads,
            KV heads replicated where needed); so are tied input/output embeddings.
    """
    if tp == 1:
        return
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    if n_q < tp:
        raise ShardkitError(f"apply_tp: {n_q} query heads cannot be split over tp={tp} ranks (whole heads per rank)")
    if n_q % n_kv:
        raise ShardkitError(f"apply_tp: {n_q} query heads are not a multiple of {n_kv} key/value heads")
    if sequence_parallel:
        if getattr(config, "kv_lora_rank", None):
            raise ShardkitError("apply_tp(sequence_parallel=True): sequence parallelism is not implemented for "
                                "multi-head latent attention (use sequence_parallel=False)")
        if getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0):
            raise ShardkitError("apply_tp(sequence_parallel=True): sequence parallelism is not implemented for "
                                "mixture-of-experts layers (use sequence_parallel=False)")
