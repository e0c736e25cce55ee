"""Pure layout rules with no torch and no library package: each returns None or the refusal.

The planner (:mod:`shardkit.plan.rules`), ``apply_tp``'s pre-launch check
(:mod:`shardkit.tensor_parallel.check`) and the trainer read them from here; here, because
``shardkit train`` checks them before ``import torch`` (issue 32) and the packages they served
from import torch.
"""

from __future__ import annotations

from types import MappingProxyType

from ._shapes import balanced_split_sizes

__all__ = [
    "batch_rule",
    "tp_heads_rule",
    "stage_heads_rule",
    "pp_layers_rule",
    "SCHEDULE_CHUNKS",
    "schedule_rule",
    "seq_len_rule",
    "cp_tokens_rule",
    "ep_rule",
    "sp_pp_tp_rule",
    "pp_tp_chunks_rule",
    "lm_spatial_rule",
    "sequence_parallel_default",
    "ac_rule",
    "parse_ac",
]

# The chunks per rank (v_min, v_max; None: unbounded) of each pipeline schedule, in the order of
# shardkit.pipeline_parallel.tables.SCHEDULES (ScheduleSpec.v_min / v_max): the registry imports
# torch through its package, and the launcher checks the schedule before import torch (issue 32).
# tests/plan/test_pipeline.py checks that the two agree.
SCHEDULE_CHUNKS = MappingProxyType(
    {
        "1f1b": (1, 1),
        "gpipe": (1, 1),
        "interleaved-1f1b": (2, None),
        "looped-bfs": (1, None),
        "zb-h1": (1, 1),
        "zbv": (2, 2),
        "interleaved-zb": (2, None),
        "dualpipev": (2, 2),
    }
)


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


def schedule_rule(schedule: str, pp: int, virtual_stages: int, microbatches: int, layers: int) -> str | None:
    """The pipeline schedule's limits (the sizes the table functions of
    :data:`shardkit.pipeline_parallel.tables.SCHEDULES` accept, from :data:`SCHEDULE_CHUNKS`).

    Args:
        schedule: ``--schedule``, a key of the registry.
        pp: pipeline ranks ``p``; with ``pp`` 1 every schedule is plain gradient accumulation.
        virtual_stages: ``--virtual-stages`` ``v``, chunks per pipeline rank.
        microbatches: ``m`` per data-parallel rank.
        layers: decoder layers, cut into ``p x v`` chunks.

    Returns:
        None, or the refusal: an unknown schedule; ``v`` outside the schedule's range (``1f1b``,
        ``gpipe``, ``zb-h1``: 1; ``interleaved-1f1b``, ``interleaved-zb``: >= 2; ``looped-bfs``:
        >= 1; ``zbv``, ``dualpipev``: 2) or ``v > 1`` without a pipeline; fewer microbatches than
        the table needs (``interleaved-1f1b``: ``m >= p`` and ``p | m``, Megatron-LM's rule;
        ``interleaved-zb``: ``max(1, m // p) | m``, torch's; ``dualpipev``: ``m >= 2p``); fewer layers than chunks
        (``layers >= p x v``).
    """
    if schedule not in SCHEDULE_CHUNKS:
        return f"--schedule must be one of {', '.join(SCHEDULE_CHUNKS)}, got {schedule!r}"
    if virtual_stages < 1:
        return f"--virtual-stages must be >= 1, got {virtual_stages}"
    if pp == 1:
        if virtual_stages != 1:
            return f"--virtual-stages {virtual_stages} needs --pp > 1 (chunks are pipeline stages of one rank)"
        return None
    lo, hi = SCHEDULE_CHUNKS[schedule]
    if virtual_stages < lo or (hi is not None and virtual_stages > hi):
        want = str(lo) if lo == hi else f">= {lo}" if hi is None else f"in {lo}..{hi}"
        return f"--schedule {schedule} needs --virtual-stages {want}, got {virtual_stages}"
    if schedule == "interleaved-1f1b" and (microbatches < pp or microbatches % pp):
        return (
            f"--schedule interleaved-1f1b with --pp {pp}: microbatches must be a multiple of pp "
            f"(groups of pp go round the chunks), got {microbatches}"
        )
    if schedule == "interleaved-zb" and microbatches % max(1, microbatches // pp):
        return (
            f"--schedule interleaved-zb with --pp {pp}: microbatches must be a multiple of "
            f"max(1, microbatches // pp) = {max(1, microbatches // pp)} (equal rounds), got {microbatches}"
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
    """Every cp rank holds at least one token of ``seq_len`` (uneven splits are fine).

    The split is ``shard_batch``'s: the zigzag ring parts of S (rank ``r`` of ``R = cp_ring``
    holds chunks ``r`` and ``2R - 1 - r`` of ``balanced_split_sizes(S, 2R)``; Ulysses alone: one
    part), each split over the Ulysses ranks.
    """
    if cp_ring * cp_ulysses == 1:
        return None
    chunks = balanced_split_sizes(seq_len, 2 * cp_ring)
    smallest = min(chunks[r] + chunks[2 * cp_ring - 1 - r] for r in range(cp_ring))
    if smallest < cp_ulysses:
        return (
            f"--seq-len {seq_len} with --cp-ring {cp_ring} --cp-ulysses {cp_ulysses}: every cp rank needs at least "
            f"one token (the smallest ring part has {smallest} tokens for {cp_ulysses} Ulysses rank(s))"
        )
    return None


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


def pp_tp_chunks_rule(pp_tp: object, schedule: str, virtual_stages: int) -> str | None:
    """Stages of their own tp sizes (``pp_tp``, not None) hold one chunk each (a one-chunk
    ``PipelineStage`` on ``StageGroups``): every one-chunk schedule runs, ``v > 1`` does not."""
    if pp_tp is None or virtual_stages == 1:
        return None
    return (
        f"--pp-tp stages hold one chunk each: --schedule {schedule} --virtual-stages {virtual_stages} cannot run "
        "on them; use a one-chunk schedule (1f1b, gpipe, zb-h1, looped-bfs) with --virtual-stages 1"
    )


def lm_spatial_rule(spatial: int, spatial_h: int) -> str | None:
    """Spatial parallelism shards images (the conv model), not token sequences."""
    if spatial != 1 or spatial_h != 1:
        flag = f"--spatial {spatial}" if spatial != 1 else f"--spatial-h {spatial_h}"
        return f"{flag} needs --model conv-ae (language models use --tp/--cp-*/--pp/--dp*)"
    return None


AC_NAMES = ("none", "full", "selective")


def ac_rule(text: str) -> str | None:
    """The refusal of an ``--ac`` value, or None: ``none``, ``full``, ``selective`` or ``selective:N``
    (``N >= 1``)."""
    name, _, every = str(text).partition(":")
    if name not in AC_NAMES or (every and name != "selective"):
        return f"--ac must be none, full, selective or selective:N, got {text!r}"
    if every and (not every.isdigit() or int(every) < 1):
        return f"--ac selective:N needs an integer N >= 1 (every N-th block checkpointed), got {text!r}"
    return None


def parse_ac(text: str) -> tuple[str, int]:
    """``--ac`` as ``(mode of a checkpointed block, every)``: ``selective:N`` is torchtitan's
    layer-level selective checkpointing, ``("full", N)``: blocks ``N - 1, 2N - 1, ...`` recompute
    whole, the others keep everything; the names are ``(name, 1)``. Pure; call :func:`ac_rule` first.

    Raises:
        ValueError: a value :func:`ac_rule` refuses.
    """
    why = ac_rule(text)
    if why is not None:
        raise ValueError(why)
    name, _, every = str(text).partition(":")
    return ("full", int(every)) if every else (name, 1)
