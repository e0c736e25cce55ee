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
* a pipeline schedule outside its table's sizes (:func:`schedule_rule`, :func:`check_schedule`).
"""

from __future__ import annotations

import torch

# torch-free rules, where the launcher checks them before import torch (issue 32)
from .._rules import batch_rule, pp_layers_rule, stage_heads_rule
from ..context_parallel._sizes import _order
from ..errors import ShardkitError
from ..pipeline_parallel.tables import SCHEDULES as SCHEDULE_TABLES

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
    "check_schedule",
]


def sequence_parallel_default(experts: bool, tp: int, pp_tp: tuple[int, ...] | None) -> bool:
    """Sequence parallelism when not asked either way: on for a dense model with tp > 1 (it
    saves activation memory at the same traffic), off for MoE models (their routers would run on
    the sequence block) and with ``pp_tp`` (:func:`sp_pp_tp_rule`)."""
    return not experts and tp > 1 and pp_tp is None


def seq_len_rule(seq_len: int) -> str | None:
    """A next-token loss needs two tokens."""
    if seq_len < 2:
        return f"--seq-len must be >= 2 (a next-token loss needs two tokens), got {seq_len}"
    return None


def cp_tokens_rule(seq_len: int, cp_ring: int, cp_ulysses: int) -> str | None:
    """Every cp rank holds at least one token of ``seq_len`` (uneven splits are fine)."""
    if cp_ring * cp_ulysses == 1:
        return None
    # shard_batch's split: the zigzag ring parts of S (Ulysses alone: one part), each split over
    # the Ulysses ranks; the rule shard_batch enforces per batch
    smallest = min(_order((0, seq_len), cp_ring, torch.device("cpu")).sizes)
    if smallest < cp_ulysses:
        return (
            f"--seq-len {seq_len} with --cp-ring {cp_ring} --cp-ulysses {cp_ulysses}: every cp rank needs at least "
            f"one token (the smallest ring part has {smallest} tokens for {cp_ulysses} Ulysses rank(s))"
        )
    return None


def schedule_rule(schedule: str, pp: int, virtual_stages: int, microbatches: int, layers: int) -> str | None:
    """The pipeline schedule's limits (:data:`shardkit.pipeline_parallel.tables.SCHEDULES`).

    Args:
        schedule: ``--schedule``, a key of the registry.
        pp: pipeline ranks ``p``; with ``pp`` 1 every schedule is plain gradient accumulation.
        virtual_stages: ``--virtual-stages`` ``v``, chunks per pipeline rank.
        microbatches: ``m`` per data-parallel rank.
        layers: decoder layers, cut into ``p x v`` chunks.

    Returns:
        None, or the refusal: an unknown schedule; ``v`` outside the schedule's range (``1f1b``,
        ``gpipe``, ``zb-h1``: 1; ``interleaved-1f1b``: >= 2; ``looped-bfs``: >= 1; ``zbv``,
        ``dualpipev``: 2) or ``v > 1`` without a pipeline; fewer microbatches than the table
        needs (``interleaved-1f1b``: ``m >= p`` and ``p | m``, Megatron-LM's rule; ``dualpipev``:
        ``m >= 2p``); fewer layers than chunks (``layers >= p x v``).
    """
    if schedule not in SCHEDULE_TABLES:
        return f"--schedule must be one of {', '.join(SCHEDULE_TABLES)}, got {schedule!r}"
    if virtual_stages < 1:
        return f"--virtual-stages must be >= 1, got {virtual_stages}"
    if pp == 1:
        if virtual_stages != 1:
            return f"--virtual-stages {virtual_stages} needs --pp > 1 (chunks are pipeline stages of one rank)"
        return None
    spec = SCHEDULE_TABLES[schedule]
    lo, hi = spec.v_min, spec.v_max
    if virtual_stages < lo or (hi is not None and virtual_stages > hi):
        want = str(lo) if lo == hi else f">= {lo}" if hi is None else f"in {lo}..{hi}"
        return f"--schedule {schedule} needs --virtual-stages {want}, got {virtual_stages}"
    if schedule == "interleaved-1f1b" and (microbatches < pp or microbatches % pp):
        return (
            f"--schedule interleaved-1f1b with --pp {pp}: microbatches must be a multiple of pp "
            f"(groups of pp go round the chunks), got {microbatches}"
        )
    if schedule == "dualpipev" and microbatches < 2 * pp:
        return f"--schedule dualpipev with --pp {pp}: microbatches must be >= 2 x pp = {2 * pp}, got {microbatches}"
    chunks = pp * virtual_stages
    if layers < chunks:
        return (
            f"--pp {pp} x --virtual-stages {virtual_stages}: {layers} decoder layers cannot fill "
            f"{chunks} chunks (need layers >= pp x virtual stages)"
        )
    return None


def check_schedule(schedule: str, pp: int, virtual_stages: int, microbatches: int, layers: int) -> None:
    """Raise :func:`schedule_rule`'s refusal.

    Raises:
        ShardkitError: the refusal of :func:`schedule_rule` (it names the flags and sizes).
    """
    if (why := schedule_rule(schedule, pp, virtual_stages, microbatches, layers)) is not None:
        raise ShardkitError(why)


def ep_rule(ep: int, experts: int) -> str | None:
    """Expert parallelism needs routed experts (``experts`` 0: a dense model)."""
    if ep > 1 and experts == 0:
        return f"--ep {ep} needs a mixture-of-experts model (--model moe or mla)"
    return None


def sp_pp_tp_rule(sequence_parallel: bool, pp_tp: tuple[int, ...] | None) -> str | None:
    """Stages of different tp sizes exchange replicated hidden states: no sequence parallelism."""
    if sequence_parallel and pp_tp is not None:
        return "--sequence-parallel with --pp-tp: stages of different tp sizes exchange replicated hidden states"
    return None


def lm_spatial_rule(spatial: int, spatial_h: int) -> str | None:
    """Spatial parallelism shards images (the conv model), not token sequences."""
    if spatial != 1 or spatial_h != 1:
        flag = f"--spatial {spatial}" if spatial != 1 else f"--spatial-h {spatial_h}"
        return f"{flag} needs --model conv-ae (language models use --tp/--cp-*/--pp/--dp*)"
    return None


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
