"""The layout rules of the decoder LMs, in one place: ``shardkit train`` and the planner read them.

Each rule is a pure function of layout sizes and model dims that returns the refusal (one
sentence naming the flags and sizes at fault) or None. :func:`shardkit.train.config.
validate_config` raises the first refusal before any process starts; the planner's
:func:`.options.check_layout` raises it (prefixed ``plan:``) for a layout it would rank, so the
two never disagree about which layouts the trainer runs.

Only real limits are rules. The layers split uneven sizes (balanced splits of query heads, the
sequence over sequence parallelism and Ulysses, the vocabulary of the vocab-parallel loss, the
FFN), so nothing asks ``tp`` or ``cp`` to divide them; what the layers cannot do is:

* a rank without a whole query head (``tp > heads``);
* with context parallelism, an uneven head split over tp (the cp attention gets the same number
  of heads on every tp rank);
* a cp rank without a token (HF layers cannot run on zero tokens): the zigzag ring parts of S,
  each split over the Ulysses ranks;
* a pipeline stage without a layer, a next-token loss on fewer than 2 tokens, a global batch
  that the data-parallel ranks and microbatches do not divide;
* expert parallelism of a dense model, sequence parallelism across stages of different tp sizes
  (they exchange replicated hidden states), spatial parallelism of an LM;
* a pipeline schedule outside its table's sizes (:func:`schedule_rule`, :func:`check_schedule`);
  ``pp_tp`` stages (one chunk each) with ``v > 1`` (:func:`pp_tp_chunks_rule`).
"""

from __future__ import annotations

# The rules are torch-free and live in shardkit._rules, where the launcher checks them before
# import torch (issue 32); this module is their public home for the planner and the trainer.
from .._rules import (
    batch_rule,
    cp_tokens_rule,
    ep_rule,
    lm_spatial_rule,
    pp_layers_rule,
    pp_tp_chunks_rule,
    schedule_rule,
    seq_len_rule,
    sequence_parallel_default,
    sp_pp_tp_rule,
    stage_heads_rule,
)
from ..errors import ShardkitError

__all__ = [
    "batch_rule",
    "seq_len_rule",
    "cp_tokens_rule",
    "stage_heads_rule",
    "pp_layers_rule",
    "ep_rule",
    "sp_pp_tp_rule",
    "lm_spatial_rule",
    "sequence_parallel_default",
    "decoder_layout_rule",
    "schedule_rule",
    "pp_tp_chunks_rule",
    "check_schedule",
]


def check_schedule(schedule: str, pp: int, virtual_stages: int, microbatches: int, layers: int) -> None:
    """Raise :func:`schedule_rule`'s refusal.

    Raises:
        ShardkitError: the refusal of :func:`schedule_rule` (it names the flags and sizes).
    """
    if (why := schedule_rule(schedule, pp, virtual_stages, microbatches, layers)) is not None:
        raise ShardkitError(why)


def decoder_layout_rule(
    dims,
    *,
    seq_len: int,
    global_batch: int,
    microbatches: int,
    sequence_parallel: bool,
    heads: int,
    kv_heads: int,
    layers: int,
    experts: int,
) -> str | None:
    """The first refusal of every rule above for a decoder LM on ``dims``, or None.

    Args:
        dims: the :class:`~shardkit.sharding.ParallelDims` (already consistent: ep borrowing, pp_tp).
        seq_len: the step's sequence length S.
        global_batch: the step's global batch B.
        microbatches: the step's microbatches M per dp rank.
        sequence_parallel: Megatron-SP with tp (resolved: not None).
        heads: the model's query heads.
        kv_heads: the model's key/value heads.
        layers: the model's decoder layers.
        experts: the model's routed experts (0 for a dense model).
    """
    sizes = dims.pp_tp or (dims.tp,) * dims.pp
    flags = [f"--pp-tp {','.join(map(str, dims.pp_tp))} (stage {s})" for s in range(dims.pp)] if dims.pp_tp else None
    checks = [
        lambda: lm_spatial_rule(dims.spatial, dims.spatial_h),
        lambda: batch_rule(global_batch, dims.dp, microbatches),
        lambda: seq_len_rule(seq_len),
        lambda: ep_rule(dims.ep, experts),
        lambda: sp_pp_tp_rule(sequence_parallel, dims.pp_tp),
        lambda: cp_tokens_rule(seq_len, dims.cp_ring, dims.cp_ulysses),
        *(
            (lambda s=s, t=t: stage_heads_rule(heads, kv_heads, t, dims.cp, flags[s] if flags else f"--tp {t}"))
            for s, t in enumerate(sizes)
        ),
        lambda: pp_layers_rule(layers, dims.pp),
    ]
    for check in checks:
        if (why := check()) is not None:
            return why
    return None
