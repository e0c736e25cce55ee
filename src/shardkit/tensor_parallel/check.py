"""Pure pre-launch checks of a model config against a tp size (no process group, no weights).

A launcher calls :func:`check_tp` before any rank builds or loads the model, so a layout
:func:`shardkit.apply_tp` would refuse is refused once, up front, instead of after the model has
loaded on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ShardkitError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["check_tp", "tp_heads_rule"]


def tp_heads_rule(heads: int, kv_heads: int, tp: int) -> str | None:
    """The refusal of :func:`shardkit.apply_tp` for ``heads`` query and ``kv_heads`` key/value
    heads over ``tp`` ranks, or None (pure; :mod:`shardkit.plan.rules` reads it for the trainer).

    Whole query heads per rank (``tp <= heads``), and query heads a multiple of the KV heads.
    Head counts ``tp`` does not divide are fine (balanced query heads, KV heads replicated where
    needed); so are tied input/output embeddings, and sequence parallelism for every supported
    family. ``tp == 1`` always passes (nothing is split).
    """
    if tp == 1:
        return None
    if heads < tp:
        return f"{heads} query heads cannot be split over tp={tp} ranks (whole heads per rank)"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} key/value heads"
    return None


def check_tp(config: PretrainedConfig, tp: int) -> None:
    """Raise the error :func:`shardkit.apply_tp` would raise for this config at ``tp`` ranks.

    Args:
        config: a Hugging Face decoder config (``num_attention_heads``, optional
            ``num_key_value_heads``).
        tp: the tp size ``R``.

    Raises:
        ShardkitError: ``apply_tp:`` and the refusal of :func:`tp_heads_rule`.
    """
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    if (why := tp_heads_rule(n_q, n_kv, tp)) is not None:
        raise ShardkitError(f"apply_tp: {why}")
