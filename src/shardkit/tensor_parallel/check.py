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

__all__ = ["check_tp"]


def check_tp(config: PretrainedConfig, tp: int) -> None:
    """Raise the error :func:`shardkit.apply_tp` would raise for this config at ``tp`` ranks.

    Args:
        config: a Hugging Face decoder config (``num_attention_heads``, optional
            ``num_key_value_heads``).
        tp: the tp size ``R``; ``tp == 1`` always passes (nothing is split).

    Raises:
        ShardkitError: fewer query heads than ``tp`` (whole heads per rank), or query heads not a
            multiple of the KV heads. Head counts ``tp`` does not divide are fine (balanced query
            heads, KV heads replicated where needed); so are tied input/output embeddings, and
            sequence parallelism for every supported family.
    """
    if tp == 1:
        return
    n_q = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_q
    if n_q < tp:
        raise ShardkitError(f"apply_tp: {n_q} query heads cannot be split over tp={tp} ranks (whole heads per rank)")
    if n_q % n_kv:
        raise ShardkitError(f"apply_tp: {n_q} query heads are not a multiple of {n_kv} key/value heads")
