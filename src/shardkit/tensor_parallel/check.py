"""Pure pre-launch checks of a model config against a tp size (no process group, no weights).

A launcher calls :func:`check_tp` before any rank builds or loads the model, so a layout
:func:`shardkit.apply_tp` would refuse is refused once, up front, instead of after the model has
loaded on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._rules import tp_heads_rule  # pure, with the launcher's other rules (no torch)
from ..errors import ShardkitError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["check_tp", "tp_heads_rule"]


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
