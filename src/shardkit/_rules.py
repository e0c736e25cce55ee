"""Pure layout rules with no torch and no library package: each returns None or the refusal.

The planner (:mod:`shardkit.plan.rules`), ``apply_tp``'s pre-launch check
(:mod:`shardkit.tensor_parallel.check`) and the trainer read them from here; here, because
``shardkit train`` checks them before ``import torch`` (issue 32) and the packages they served
from import torch.
"""

from __future__ import annotations

__all__ = ["batch_rule", "tp_heads_rule", "stage_heads_rule", "pp_layers_rule"]


def batch_rule(global_batch: int, dp: int, microbatches: int) -> str | None:
    """Every data-parallel rank takes ``global_batch / dp`` rows, cut into ``microbatches``."""
    if global_batch % (dp * microbatches):
        what = f"dp={dp} x microbatches={microbatches}" if microbatches > 1 else f"dp={dp}"
        return f"--batch-size {global_batch} (global) must be divisible by {what}"
    return None


def tp_heads_rule(heads: int, kv_heads: int, tp: int) -> str | None:
    """The refusal of :func:`shardkit.apply_tp` for ``heads`` query and ``kv_heads`` key/value
    heads over ``tp`` ranks, or None (pure; :mod:`shardkit.tensor_parallel.check` and
    :func:`stage_heads_rule` read it).

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


def stage_heads_rule(heads: int, kv_heads: int, tp: int, cp: int, flag: str) -> str | None:
    """Whole query heads on every tp rank (:func:`tp_heads_rule`, apply_tp's own rule); with cp,
    the same number of them on every tp rank.

    Args:
        heads: the model's query heads.
        kv_heads: the model's key/value heads.
        tp: the tp size of one stage.
        cp: ``cp_ring x cp_ulysses``.
        flag: how the message names this tp size (``--tp 4``, ``--pp-tp 2,1 (stage 0)``).
    """
    if (why := tp_heads_rule(heads, kv_heads, tp)) is not None:
        return f"{flag}: {why}"
    if tp > 1 and cp > 1 and (heads % tp or kv_heads % tp):
        return (
            f"{flag} with context parallelism: tp must divide num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads} (whole query and key/value heads per rank)"
        )
    return None


def pp_layers_rule(layers: int, pp: int) -> str | None:
    """Every pipeline stage holds at least one decoder layer."""
    if layers < pp:
        return f"--pp {pp}: {layers} decoder layers cannot fill {pp} pipeline stages (need layers >= pp)"
    return None
