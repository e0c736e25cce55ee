"""The collectives of one training step of the composed trainer, per rank, as its CommLedger
records them: op, issuing api, phase, group size, count and buffer bytes.

Rules (``T`` = tokens of one microbatch on this rank = ``b x S / cp`` with ``b`` rows per
microbatch, ``e`` bytes per element, ``t`` = tp, per microbatch unless said):

* tp without SP (Megatron f/g): the vocab-parallel embedding all-reduces ``[T, H]`` (first
  stage); every layer all-reduces its row-parallel outputs (forward: attention, dense MLP,
  shared or tensor-parallel experts) and the inputs of its column-parallel groups (backward);
  ``lm_head``'s input too. With expert parallelism each tp rank splits off its block of the
  (replicated) tokens with their routing weights, and the outputs are gathered back.
* tp with SP (Korthikanti et al.): every tensor-parallel region (attention, dense MLP, an MoE
  block with tensor-parallel experts as one region, the shared experts of an expert-parallel
  block) all-gathers its input ``[T/t, H] -> [T, H]`` forward and reduce-scatters its output,
  their adjoints in backward; an expert-parallel MoE block runs on the rank's own sequence
  block (no gather) and its router's gradient ``[E, H]`` is summed over tp; the norms'
  gradients summed over tp (``H`` each); the first layer of the embedding's chunk
  splits its input (backward: all-gather), the head gathers ``lm_head``'s input; stage
  boundaries carry the sequence blocks (no split or gather there), except ``pp_tp``'s
  (replicated: the first layer of a stage splits its input, a stage before the last gathers
  its output).
* with or without SP, inside the blocks: MLA's column-parallel inputs all-reduced in backward
  (its latent ``[T, kv_lora]``, rope key ``[T, rope]`` and ``[T, q_lora]``), and the routing
  weights ``[T, k]`` of tensor-parallel experts.
* the logits: gathered over the vocabulary ``[T, V/t] -> [T, V]``; with the vocab-parallel loss
  two all-reduces instead, ``(T + 2 t + 2)`` float64 (max: row maxima, widths, labels'
  verdicts, fingerprint) and ``(2 T + 1)`` (sums).
* Ulysses (``u`` ranks): per layer one all-to-all of q, k, v ``[T, (N + 2 N_kv)/t, D]`` and one
  of the output ``[T, N/t, Dv]``, forward and backward; with MLA's values narrower than its
  queries and keys (``Dv != Dqk = nope + rope``) q and k travel together and v alone.
* ring (``r`` ranks, zigzag): per layer ``r - 1`` K/V shifts forward and ``2 r - 1`` backward
  (K/V again, then dK/dV home), each ``b x S/r x N_kv/(t u) x (Dqk + Dv)`` elements; dK/dV
  travel in float32 when the dtype is narrower.
* ep: per MoE layer the counts ``R x (ceil(E/R) + 1)`` int64, then dispatch and combine of
  ``T/t x k`` rows of ``H`` forward and backward (each tp rank dispatches its block of the
  tokens: split off the replicated tokens, or its own sequence block with SP). The rows each
  rank *receives* depend on the router; the rows are given for a balanced router (received =
  sent), their sum over the ranks is exact.
* pp: every transfer between stages is a 160-byte header plus the hidden states: with SP
  (tp > 1) each tp rank's own sequence block ``[b, S_r, H]``, ``S_r`` its balanced share of
  ``S/cp`` over tp (Megatron-LM's pipeline under SP: ``tp`` times fewer bytes per rank), else
  ``[b, S/cp, H]`` (replicated over tp); the first transfer of a step on each channel posts them
  as two messages, later ones as one (the shape cache). A channel is a receiving chunk and direction:
  with ``v`` looped chunks per rank each microbatch crosses every rank boundary ``v`` times each
  way; a V's turn from chunk ``p - 1`` to ``p`` stays on the last rank (no P2P), and stage 0
  holds the embedding and the head. ``pp_tp`` (stages of different tp sizes, replicated
  boundaries): in the replica's group, forward transfers are a header and the payload every
  time, backward ones the payload only; between stages of equal tp every rank sends to its peer,
  otherwise the leaders exchange the tensor and the receiving leader broadcasts it in its stage.
* pp, once per step: ``run_schedule`` agrees on its arguments (one max all-reduce of 4 int64).
* once per step: dense gradients FSDP2 does not own (all with ``dp_shard`` 1; else the
  sum-over-tp ones) all-reduced over ``dp_cp``; expert gradients over ``edp`` (with
  ``dp_shard`` 1; else FSDP2 reduce-scatters them there, below); the gradient
  norm and the loss (one float64 each) over the world.
* FSDP2 (api ``fully_shard``, recorded through shardkit's custom all-gather and
  reduce-scatter, see :mod:`shardkit.data_parallel.fsdp`): every decoder layer and the root
  (embedding, final norm, ``lm_head``; a group only on a rank holding one of them) are ``G`` =
  layers + 1 groups, and with ``ep > 1`` each MoE
  layer's experts one more group over ``edp`` (its expert weights; none when ``edp`` is 1). With ``M > 1``
  microbatches (accumulation or a pipeline, :func:`shardkit.data_parallel.set_microbatch`; on
  virtual stages each group after its last backward step), and under an I/W split, every
  group is all-gathered once per step, before the step's first forward, and its gradients are
  reduce-scattered (with HSDP, each shard all-reduced over ``dp_replicate``) once, after the last
  backward. With one microbatch every layer is gathered before forward and again before backward,
  the root (never resharded after forward) once, before forward; each group is reduced once. Bytes
  are the parameters FSDP2 owns; its padding of each parameter's dim 0 to a multiple of the
  ranks is left out (none when dim 0 divides evenly).

Source: the trainer (:mod:`shardkit.train.trainer`) and the transforms it composes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .._shapes import balanced_split_sizes
from ..pipeline_parallel.tables import SCHEDULES as SCHEDULE_TABLES
from ..sharding import ParallelDims
from ._rows import CommRow, Rows
from ._tp import tp_rows
from .model import ModelShape
from .options import (
    StepOptions,
    check_layout,
    expert_fsdp_ranks,
    fsdp_once_per_step,
    hooked_params,
    resolve_options,
    stage_part,
    stage_tp,
    zero_buckets,
)

__all__ = ["CommRow", "step_collectives", "merged", "ledger_table", "HEADER_BYTES"]

# point-to-point calls that are not pipeline transfers: ring attention's, async TP's rings
_RING_APIS = ("ring_attention", "all_gather_matmul", "matmul_reduce_scatter", "sp_regather")
HEADER_BYTES = 160  # the P2P shape header: 20 int64 (dtype, ndim, up to 16 dims, ...)


def step_collectives(
    shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int = 0, tp_rank: int = 0
) -> list[CommRow]:
    """The collectives of one training step on a rank of pipeline stage ``stage``: shardkit's and
    FSDP2's (which shardkit records too).

    Args:
        shape: the model. dims: the layout. opts: the step's options.
        stage: the rank's pipeline stage (0 when ``pp`` is 1).
        tp_rank: the rank's place in its stage's tp group; it matters with ``pp_tp`` only, where
            the stage leader (0) alone talks to a neighbour stage of another tp size
            (:func:`~shardkit.plan.options.rank_stage` gives both for a global rank).

    Returns:
        One :class:`CommRow` per ``(axis, op, api, phase, group size)``; equal to the trainer's
        :class:`~shardkit.CommLedger` of that step (for ep: the counts and bytes sent exactly,
        the bytes received for a balanced router).

    Raises:
        ShardkitError: a layout the trainer refuses (:func:`check_layout`).
    """
    opts = resolve_options(shape, dims, opts)
    check_layout(shape, dims, opts)
    e, tp, M, H = opts.elem, stage_tp(dims, stage), opts.microbatches, shape.hidden
    b = opts.global_batch // (dims.dp * M)
    S = opts.seq_len // dims.cp
    T = b * S
    out = Rows()
    layers, first, last = stage_part(shape, dims, opts, stage)
    if tp > 1:
        sharded = dims.pp > 1 and dims.pp_tp is None  # SP boundaries carry the blocks (no split, no gather)
        tp_rows(out, shape, opts, layers, first, last, T, M, tp, dims.ep, sharded_boundaries=sharded)
    dk, dv = shape.qk_dim, shape.v_dim
    if dims.cp_ulysses > 1:
        q, kv = shape.heads // tp, max(1, shape.kv_heads // tp)
        # q, k, v in one buffer; with MLA's narrower values (dv != dk) q and k in one, v in another
        widths = [(q + 2 * kv) * dk] if dk == dv else [(q + kv) * dk, kv * dv]
        for phase in ("forward", "backward"):
            for width in widths + [q * dv]:  # then the output back
                out.add(
                    "cp",
                    "all_to_all_single",
                    "ulysses_attention",
                    phase,
                    dims.cp_ulysses,
                    M * len(layers),
                    T * width * e,
                    T * width * e,
                )
    if dims.cp_ring > 1:
        r = dims.cp_ring
        kv = max(1, shape.kv_heads // tp) // dims.cp_ulysses
        elems = b * (opts.seq_len // r) * kv * (dk + dv)
        n = M * len(layers)
        # forward: r - 1 K/V shifts; backward: r - 1 K/V shifts again, then r dK/dV shifts home,
        # accumulated in float32 for narrower dtypes (fp32 accumulation of the partial gradients)
        total = {"forward": (r - 1) * elems * e, "backward": ((r - 1) * e + r * max(e, 4)) * elems}
        for phase, steps in (("forward", r - 1), ("backward", 2 * r - 1)):
            out.add_total("cp", "send", "ring_attention", phase, r, n * steps, n * total[phase], 0)
            out.add_total("cp", "recv", "ring_attention", phase, r, n * steps, 0, n * total[phase])
    if dims.ep > 1:
        _ep_rows(out, shape, dims, layers, T, M, e)
    if dims.pp_tp is not None:
        _vtp_rows(out, dims.pp_tp, stage, tp_rank, M, b * S * H * e)
    elif dims.pp > 1:
        rows = balanced_split_sizes(S, tp)[tp_rank] if opts.sequence_parallel and tp > 1 else S
        _pp_rows(out, dims.pp, _pp_channels(dims, opts, stage), M, b * rows * H * e)
    if dims.pp > 1:  # run_schedule's argument agreement (shardkit.comm.agree): 4 int64, max-reduced
        pp_group = sum(dims.pp_tp) if dims.pp_tp is not None else dims.pp
        out.add("pp", "all_reduce", "run_schedule", "check", pp_group, 1, 32, 32)
    _grad_rows(out, shape, dims, opts, stage)
    _fsdp_rows(out, shape, dims, opts, stage)
    world = dims.product
    out.add("world", "all_reduce", "grad_norm", "optimizer", world, 1, 8, 8)
    loss = 16 if dims.pp > 1 else 8  # a pipeline's trusted-shape flag travels with the loss sum
    out.add("world", "all_reduce", "train_loss", "forward", world, 1, loss, loss)
    return out.result()


def _ep_rows(out: Rows, shape: ModelShape, dims: ParallelDims, layers: list[int], T: int, M: int, e: int) -> None:
    R, k, H = dims.ep, shape.top_k, shape.hidden
    T //= dims.tp  # each tp rank dispatches its block: of the replicated tokens, or with SP its own
    n = sum(shape.is_moe_layer(i) for i in layers)
    counts = R * (math.ceil(shape.experts / R) + 1) * 8
    rows = T * k * H * e
    out.add("ep", "all_to_all_single", "dispatch_plan", "forward", R, M * n, counts, counts)
    for api in ("token_dispatch", "token_combine"):
        for phase in ("forward", "backward"):
            out.add("ep", "all_to_all_single", api, phase, R, M * n, rows, rows)


def _pp_channels(dims: ParallelDims, opts: StepOptions, stage: int) -> dict[tuple[str, str], int]:
    """``{(op, phase): channels}`` of stage ``stage``: the chunk boundaries its P2P crosses.

    A channel is one receiving chunk and direction (the runners' shape caches). One chunk per
    rank, or looped chunks: every chunk but the model's first receives activations from the
    rank before and sends back their gradients, every chunk but the last sends activations on
    and receives gradients (each microbatch crosses every rank boundary ``v`` times each way). A
    V (``v = 2``): the hand-over from chunk ``p - 1`` to ``p`` is local to the last rank, so each
    of a stage's two chunks talks to a neighbour only where that neighbour exists."""
    v, p = (opts.virtual_stages, dims.pp)
    spec = SCHEDULE_TABLES.get(opts.schedule)
    if spec is not None and spec.placement == "v" and v == 2:
        n = (stage < p - 1) + (stage > 0)
        return {(op, phase): n for op in ("send", "recv") for phase in ("forward", "backward")}
    takes, ends = v - (stage == 0), v - (stage == p - 1)  # chunks with a previous / a next one
    return {
        ("recv", "forward"): takes,
        ("send", "backward"): takes,
        ("send", "forward"): ends,
        ("recv", "backward"): ends,
    }


def _pp_rows(out: Rows, pp: int, channels: dict[tuple[str, str], int], M: int, act: int) -> None:
    # each channel: M transfers of header + payload; the first as two messages, the rest as one
    total = M * (act + HEADER_BYTES)
    for (op, phase), n in channels.items():
        if n:
            sent = n * total if op == "send" else 0
            out.add_total("pp", op, "p2p", phase, pp, n * (M + 1), sent, n * total - sent)


def _vtp_rows(out: Rows, sizes: tuple[int, ...], stage: int, tp_rank: int, M: int, act: int) -> None:
    """``pp_tp`` boundaries (replicated both sides, :mod:`shardkit.pipeline_parallel._reshard`):
    between stages of equal tp every rank sends to its peer; otherwise the sending stage's leader
    sends the whole tensor to the receiving leader, which broadcasts it in its stage. Forward
    transfers are dynamic (a header, then the payload: two messages each); backward ones are
    declared (the payload only). P2P runs in the replica's group of ``sum(pp_tp)`` ranks."""
    group, t, leader = sum(sizes), sizes[stage], tp_rank == 0
    fwd, bwd = M * (act + HEADER_BYTES), M * act
    for peer, sending in ((stage + 1, True), (stage - 1, False)):  # the next stage, then the previous one
        if not 0 <= peer < len(sizes):
            continue
        direct = sizes[peer] == t
        if direct or leader:
            out.add_total(
                "pp", "send" if sending else "recv", "p2p", "forward", group, 2 * M, fwd * sending, fwd * (not sending)
            )
            out.add_total(
                "pp", "recv" if sending else "send", "p2p", "backward", group, M, bwd * (not sending), bwd * sending
            )
        if not direct:  # this stage receives through its leader: backward from the next, forward from the previous
            count, size = (M, bwd) if sending else (2 * M, fwd)
            out.add_total(
                "pp",
                "broadcast",
                "p2p",
                "backward" if sending else "forward",
                t,
                count,
                size * leader,
                size * (not leader),
            )


def _zero_rows(out: Rows, shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> None:
    """ZeRO's calls per padded bucket of ``n`` elements over ``r`` ranks, both stages: a
    reduce-scatter (``1 / r`` received), then the updated slices all-gathered."""
    e = opts.elem
    for (n, r), api in zip(zero_buckets(shape, dims, opts, stage), ("dp_cp_grads", "expert_grads")):
        out.add("dp", "reduce_scatter_single", api, "backward", r, 1, n * e, n // r * e)
        out.add("dp", "all_gather_single", "zero_params", "optimizer", r, 1, n // r * e, n * e)


def _grad_rows(out: Rows, shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> None:
    if opts.zero:
        _zero_rows(out, shape, dims, opts, stage)
        return
    e = opts.elem
    ep = dims.ep
    dense, expert = shape.rank_params(stage_tp(dims, stage), ep, part=stage_part(shape, dims, opts, stage))
    if ep == 1:
        dense, expert = dense + expert, 0
    if dims.dp_shard > 1:
        dense = hooked_params(shape, dims, opts, stage)  # FSDP2 owns the rest
    if dense:  # no bucket, no call
        out.add("dp", "all_reduce", "dp_cp_grads", "backward", dims.dp * dims.cp, 1, dense * e, dense * e)
    edp = dims.dp_replicate * dims.ep_borrow // ep
    if ep > 1 and expert and dims.dp_shard == 1:  # with dp_shard, FSDP2 reduces them over edp
        out.add("dp", "all_reduce", "expert_grads", "backward", edp, 1, expert * e, expert * e)


def _fsdp_rows(out: Rows, shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> None:
    if dims.dp_shard == 1:
        return
    R, M, e = dims.dp_shard * dims.cp, opts.microbatches, opts.elem
    part = layers, first, last = stage_part(shape, dims, opts, stage)
    dense, expert = shape.rank_params(dims.tp, dims.ep, part=part)
    owned = dense + (expert if dims.ep == 1 else 0) - hooked_params(shape, dims, opts, stage)
    per_layer = [shape.layer_params(i, dims.tp, dims.ep) for i in layers]
    layer_owned = sum(d + (x if dims.ep == 1 else 0) for d, x in per_layer) - hooked_params(shape, dims, opts, stage)
    if opts.sequence_parallel and last:
        layer_owned += shape.hidden  # the final norm's hook is the root's, not a layer's
    G = len(layers) + (first or last)  # the root is a group where it holds the embedding or the head
    experts = [x * e for _, x in per_layer if x and dims.ep > 1]  # their own FSDP2 groups over edp
    if fsdp_once_per_step(dims, opts):  # set_microbatch: every group gathered and reduced once
        full = owned * e
        out.add_total("fsdp", "all_gather_single", "fully_shard", "forward", R, G, full // R, full)
        out.add_total("fsdp", "reduce_scatter_single", "fully_shard", "backward", R, G, full, full // R)
        out.add_total("fsdp", "all_reduce", "fully_shard", "backward", dims.dp_replicate, G, full // R, full // R)
        _expert_fsdp_rows(out, experts, expert_fsdp_ranks(dims), 1, once=True)
        return
    # M = 1, F/B steps: every layer is resharded after its forward and gathered again for its
    # backward; the root (FSDP2 never reshards it after forward) only before the first forward
    full, layer_full = M * owned * e, M * layer_owned * e
    gathered_f = layer_full + (owned - layer_owned) * e
    out.add_total("fsdp", "all_gather_single", "fully_shard", "forward", R, M * G, gathered_f // R, gathered_f)
    out.add_total("fsdp", "all_gather_single", "fully_shard", "backward", R, M * (G - 1), layer_full // R, layer_full)
    out.add_total("fsdp", "reduce_scatter_single", "fully_shard", "backward", R, M * G, full, full // R)
    out.add_total("fsdp", "all_reduce", "fully_shard", "backward", dims.dp_replicate, M * G, full // R, full // R)
    _expert_fsdp_rows(out, experts, expert_fsdp_ranks(dims), M, once=False)


def _expert_fsdp_rows(out: Rows, sizes: list[int], edp: int, microbatches: int, once: bool) -> None:
    """Each MoE layer's experts module, its own FSDP2 group over ``edp`` (``sizes``: its bytes):
    gathered and reduced once per step under ``set_microbatch`` (``once``), else gathered before
    each microbatch's forward and again before its backward, and reduced after each backward."""
    n, full, shard = len(sizes), sum(sizes), sum(s // edp for s in sizes)
    times = 1 if once else microbatches
    out.add_total("fsdp", "all_gather_single", "fully_shard", "forward", edp, n * times, shard * times, full * times)
    if not once:  # resharded after forward like the blocks
        out.add_total(
            "fsdp", "all_gather_single", "fully_shard", "backward", edp, n * times, shard * times, full * times
        )
    out.add_total(
        "fsdp", "reduce_scatter_single", "fully_shard", "backward", edp, n * times, full * times, shard * times
    )


def merged(rows: Iterable[CommRow]) -> dict[tuple[str, str, str, int], tuple[int, int, int]]:
    """``{(op, api, phase, group_size): (count, bytes_sent, bytes_received)}`` summed over axes."""
    table: dict[tuple[str, str, str, int], tuple[int, int, int]] = {}
    for r in rows:
        c, s, v = table.get(r.key(), (0, 0, 0))
        table[r.key()] = (c + r.count, s + r.bytes_sent, v + r.bytes_received)
    return table


def ledger_table(records: Iterable) -> dict[tuple[str, str, str, int], tuple[int, int, int]]:
    """A :class:`~shardkit.CommLedger`'s records in the form of :func:`merged`: pipeline
    transfers (every ``send``/``recv`` but ring attention's, and the ``pp_tp`` stage
    broadcasts) under the api ``"p2p"``, since which combined call carries a transfer is the
    schedule's choice, not a cost."""
    table: dict[tuple[str, str, str, int], tuple[int, int, int]] = {}
    for r in records:
        pipeline = r.op == "broadcast" or (r.op in ("send", "recv") and r.api not in _RING_APIS)
        api = "p2p" if pipeline else r.api
        key = (r.op, api, r.phase, r.group_size)
        c, s, v = table.get(key, (0, 0, 0))
        table[key] = (c + 1, s + r.bytes_sent, v + r.bytes_received)
    return table
