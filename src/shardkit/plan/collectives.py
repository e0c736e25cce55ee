"""The collectives of one training step of the composed trainer, per rank, as its CommLedger
records them: op, issuing api, phase, group size, count and buffer bytes.

Rules (``T`` = tokens of one microbatch on this rank = ``b x S / cp`` with ``b`` rows per
microbatch, ``e`` bytes per element, ``t`` = tp, per microbatch unless said):

* tp without SP (Megatron f/g): the vocab-parallel embedding all-reduces ``[T, H]`` (first
  stage); every layer all-reduces its row-parallel outputs (forward: attention, dense MLP,
  shared or tensor-parallel experts) and the inputs of its column-parallel groups (backward;
  MLA adds its latent ``[T, kv_lora]`` and rope key ``[T, rope]``, tensor-parallel experts
  their routing weights ``[T, k]``); ``lm_head``'s input too.
* tp with SP (Korthikanti et al.): per layer two all-gathers ``[T/t, H] -> [T, H]`` forward and
  two reduce-scatters back, their adjoints in backward; the norms' gradients summed over tp
  (``H`` each); the first layer of a stage splits its input (backward: all-gather); a stage
  before the last gathers its output, the last gathers ``lm_head``'s input.
* the logits: gathered over the vocabulary ``[T, V/t] -> [T, V]``; with the vocab-parallel loss
  two all-reduces instead, ``(T + t + 2)`` float64 (max) and ``(2 T + 1)`` (sums).
* Ulysses (``u`` ranks): per layer one all-to-all of q, k, v ``[T, (N + 2 N_kv)/t, D]`` and one
  of the output ``[T, N/t, D]``, forward and backward.
* ring (``r`` ranks, zigzag): per layer ``r - 1`` K/V shifts forward and ``2 r - 1`` backward
  (K/V again, then dK/dV home), each ``2 x b x S/r x N_kv/(t u) x D`` elements; dK/dV travel
  in float32 when the dtype is narrower.
* ep: per MoE layer the counts ``R x (ceil(E/R) + 1)`` int64, then dispatch and combine of
  ``T/t x k`` rows of ``H`` forward and backward (tokens are replicated over tp: each tp rank
  splits off its block, with its routing weights, and the outputs are gathered back). The rows each rank *receives* depend on the
  router; the rows are given for a balanced router (received = sent), their sum over the ranks
  is exact.
* pp: every transfer between stages is a 160-byte header plus ``[b, S/cp, H]`` (replicated over
  tp); the first transfer of a step on each channel posts them as two messages, later ones as
  one (the shape cache).
* once per step: dense gradients FSDP2 does not own (all with ``dp_shard`` 1; else the
  sum-over-tp ones) all-reduced over ``dp_cp``; expert gradients over ``edp``; the gradient
  norm and the loss (one float64 each) over the world.
* FSDP2 (api ``fully_shard``, recorded through shardkit's custom all-gather and
  reduce-scatter, see :mod:`shardkit.data_parallel.fsdp`): every decoder layer and the root
  (embedding, final norm, ``lm_head``) are ``G`` = layers + 1 groups. Per microbatch every layer
  is all-gathered before forward and again before backward; the root is resharded after
  backward only, so it is gathered by the step's first action and each action after a backward
  (in the 1F1B order: a warm-up forward keeps it). Every group's gradients are
  reduce-scattered per microbatch, and with HSDP each shard is all-reduced over ``dp_replicate``. Bytes are the parameters FSDP2 owns; its padding of each
  parameter's dim 0 to a multiple of the ranks is left out (none when dim 0 divides evenly).

Source: the trainer (:mod:`shardkit.cli.trainer`) and the transforms it composes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..mesh import ParallelDims
from .model import ModelShape
from .options import SCHEDULES, StepOptions, check_layout, hooked_params, resolve_options, stage_tp

__all__ = ["CommRow", "step_collectives", "merged", "ledger_table", "HEADER_BYTES"]

HEADER_BYTES = 160  # the P2P shape header: 20 int64 (dtype, ndim, up to 16 dims, ...)


@dataclass(frozen=True)
class CommRow:
    """Calls of one kind in one step on one rank.

    Attributes:
        axis: the layout axis it belongs to (``tp``, ``cp``, ``ep``, ``pp``, ``dp``, ``fsdp``, ``world``).
        op: the c10d primitive (as :class:`shardkit.CommRecord`).
        api: the shardkit function that issues it (``"p2p"`` for pipeline transfers).
        phase: ``forward``, ``backward`` or ``optimizer``.
        group_size: ranks in the group.
        count: calls per step.
        bytes_sent: input buffer bytes, summed over the calls.
        bytes_received: output buffer bytes, summed over the calls.
    """

    axis: str
    op: str
    api: str
    phase: str
    group_size: int
    count: int
    bytes_sent: int
    bytes_received: int

    def key(self) -> tuple[str, str, str, int]:
        return self.op, self.api, self.phase, self.group_size


class _Rows:
    def __init__(self) -> None:
        self.rows: dict[tuple, list[int]] = {}

    def add(self, axis: str, op: str, api: str, phase: str, group: int, count: int, sent: int, recv: int) -> None:
        """``count`` calls of ``sent`` / ``recv`` bytes each."""
        self.add_total(axis, op, api, phase, group, count, count * sent, count * recv)

    def add_total(self, axis: str, op: str, api: str, phase: str, group: int, count: int, sent: int,
                  recv: int) -> None:
        """``count`` calls of ``sent`` / ``recv`` bytes in all."""
        if group <= 1 or count <= 0:
            return  # a size-1 group is the identity: no call
        row = self.rows.setdefault((axis, op, api, phase, group), [0, 0, 0])
        row[0] += count
        row[1] += sent
        row[2] += recv

    def result(self) -> list[CommRow]:
        return [CommRow(*key, *vals) for key, vals in self.rows.items()]


def step_collectives(shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int = 0,
                     tp_rank: int = 0) -> list[CommRow]:
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
    out = _Rows()
    first, last = stage == 0, stage == dims.pp - 1
    layers = list(shape.stage_layers(dims.pp, stage))
    if tp > 1:
        _tp_rows(out, shape, opts, layers, first, last, T, M, tp, dims.ep)
    dk, dv = shape.qk_dim, shape.v_dim
    if dims.cp_ulysses > 1:
        q, kv = shape.heads // tp, max(1, shape.kv_heads // tp)
        # q, k, v in one buffer; with MLA's narrower values (dv != dk) q and k in one, v in another
        widths = [(q + 2 * kv) * dk] if dk == dv else [(q + kv) * dk, kv * dv]
        for phase in ("forward", "backward"):
            for width in widths + [q * dv]:  # then the output back
                out.add("cp", "all_to_all_single", "ulysses_attention", phase, dims.cp_ulysses, M * len(layers),
                        T * width * e, T * width * e)
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
        _pp_rows(out, dims.pp, first, last, M, b * S * H * e)
    _grad_rows(out, shape, dims, opts, stage)
    _fsdp_rows(out, shape, dims, opts, stage)
    world = dims.product
    out.add("world", "all_reduce", "grad_norm", "optimizer", world, 1, 8, 8)
    out.add("world", "all_reduce", "train_loss", "forward", world, 1, 8, 8)
    return out.result()


def _tp_rows(out: _Rows, shape: ModelShape, opts: StepOptions, layers: list[int], first: bool, last: bool, T: int,
             M: int, t: int, ep: int) -> None:
    e, H, n = opts.elem, shape.hidden, len(layers)
    full, part = T * H * e, T // t * H * e
    add = out.add
    if first:
        add("tp", "all_reduce", "all_reduce_forward", "forward", t, M, full, full)  # vocab-parallel embedding
    if shape.family in ("qwen3", "qwen3_moe"):
        add("tp", "all_reduce", "sum_grad_over", "backward", t, M * 2 * n, shape.head_dim * e, shape.head_dim * e)
    if shape.kv_heads < t and not shape.mla:  # replicated key/value heads: their weight gradients summed
        add("tp", "all_reduce", "sum_grad_over", "backward", t, M * 2 * n, shape.head_dim * H * e,
            shape.head_dim * H * e)
    for i in layers:  # column-parallel inputs inside a block, with or without SP (f: backward all-reduce)
        if shape.mla:  # kv_b_proj's input [T, kv_lora], the shared rope key [T, rope], q_b_proj's [T, q_lora]
            for width in (shape.kv_lora_rank, shape.qk_rope_dim) + ((shape.q_lora_rank,) if shape.q_lora_rank else ()):
                add("tp", "all_reduce", "all_reduce_backward", "backward", t, M, T * width * e, T * width * e)
        if shape.is_moe_layer(i) and ep == 1:  # tensor-parallel experts: the routing weights [T, k]
            add("tp", "all_reduce", "all_reduce_backward", "backward", t, M, T * shape.top_k * e, T * shape.top_k * e)
    if opts.sequence_parallel:
        _sp_rows(out, shape, layers, last, T, M, t, e, ep)
    else:
        _megatron_rows(out, shape, layers, last, T, M, t, e, ep)
    if last:
        if opts.loss_parallel:
            cdt = 4 if e < 4 else e
            add("tp", "all_reduce", "vocab_parallel_cross_entropy", "forward", t, M, (T + t + 2) * 8, (T + t + 2) * 8)
            add("tp", "all_reduce", "vocab_parallel_cross_entropy", "forward", t, M, (2 * T + 1) * cdt, (2 * T + 1) * cdt)
        else:
            logits = T * shape.vocab * e
            add("tp", "all_gather_single", "gather_forward_split_backward", "forward", t, M, logits // t, logits)


def _sp_rows(out: _Rows, shape: ModelShape, layers: list[int], last: bool, T: int, M: int, t: int, e: int,
             ep: int) -> None:
    """tp with SP: every tensor-parallel region gathers its input ``[T/t, H] -> [T, H]`` and
    reduce-scatters its output; an expert-parallel MoE block runs on the local block (only its
    shared experts are a region) and its router's gradient is summed over tp."""
    H, n = shape.hidden, len(layers)
    full, part = T * H * e, T // t * H * e
    regions = routers = 0  # per microbatch
    for i in layers:
        regions += 1  # attention
        if not shape.is_moe_layer(i) or ep == 1 or shape.shared_experts:
            regions += 1  # dense MLP, an MoE block with tensor-parallel experts, or the shared experts
        if shape.is_moe_layer(i) and ep > 1:
            routers += 1
    add = out.add
    add("tp", "all_gather_single", "all_gather", "forward", t, M * (regions + last), part, full)
    add("tp", "reduce_scatter_single", "all_gather", "backward", t, M * (regions + last), full, part)
    add("tp", "reduce_scatter_single", "reduce_scatter", "forward", t, M * regions, full, part)
    add("tp", "all_gather_single", "reduce_scatter", "backward", t, M * regions, part, full)
    add("tp", "all_reduce", "sum_grad_over", "backward", t, M * (2 * n + last), H * e, H * e)
    add("tp", "all_reduce", "sum_grad_over", "backward", t, M * routers, shape.experts * H * e, shape.experts * H * e)
    add("tp", "all_gather_single", "split_forward_gather_backward", "backward", t, M, part, full)
    if not last:
        add("tp", "all_gather_single", "gather_forward_split_backward", "forward", t, M, part, full)


def _megatron_rows(out: _Rows, shape: ModelShape, layers: list[int], last: bool, T: int, M: int, t: int, e: int,
                   ep: int) -> None:
    """tp without SP: ``g`` (forward all-reduce) after every row-parallel output, ``f`` (backward
    all-reduce) on every column-parallel input, per layer and microbatch."""
    H, full = shape.hidden, T * shape.hidden * e
    fwd = bwd = 0  # [T, H] calls per microbatch
    for i in layers:
        fwd, bwd = fwd + 1, bwd + 1  # o_proj; the q/k/v (MLA: q_proj or q_a_proj) input
        if not shape.is_moe_layer(i):
            fwd, bwd = fwd + 1, bwd + 1  # dense MLP
            continue
        if shape.shared_experts:
            fwd, bwd = fwd + 1, bwd + 1
        if ep > 1:  # each tp rank dispatches its block of the tokens: split (with the routing weights), gather
            k = shape.top_k
            out.add("tp", "all_gather_single", "gather_forward_split_backward", "forward", t, M, T // t * H * e, full)
            out.add("tp", "all_gather_single", "split_forward_gather_backward", "backward", t, M,
                    T // t * (H + k) * e, T * (H + k) * e)
        else:  # tensor-parallel experts: partial outputs summed
            fwd, bwd = fwd + 1, bwd + 1
    out.add("tp", "all_reduce", "all_reduce_forward", "forward", t, M * fwd, full, full)
    out.add("tp", "all_reduce", "all_reduce_backward", "backward", t, M * (bwd + last), full, full)


def _ep_rows(out: _Rows, shape: ModelShape, dims: ParallelDims, layers: list[int], T: int, M: int, e: int) -> None:
    R, k, H = dims.ep, shape.top_k, shape.hidden
    T //= dims.tp  # tokens are replicated over tp: each tp rank dispatches its block
    n = sum(shape.is_moe_layer(i) for i in layers)
    counts = R * (math.ceil(shape.experts / R) + 1) * 8
    rows = T * k * H * e
    out.add("ep", "all_to_all_single", "dispatch_plan", "forward", R, M * n, counts, counts)
    for api in ("token_dispatch", "token_combine"):
        for phase in ("forward", "backward"):
            out.add("ep", "all_to_all_single", api, phase, R, M * n, rows, rows)


def _pp_rows(out: _Rows, pp: int, first: bool, last: bool, M: int, act: int) -> None:
    # each channel: M transfers of header + payload; the first as two messages, the rest as one
    total = M * (act + HEADER_BYTES)
    if not last:
        out.add_total("pp", "send", "p2p", "forward", pp, M + 1, total, 0)
        out.add_total("pp", "recv", "p2p", "backward", pp, M + 1, 0, total)
    if not first:
        out.add_total("pp", "recv", "p2p", "forward", pp, M + 1, 0, total)
        out.add_total("pp", "send", "p2p", "backward", pp, M + 1, total, 0)


def _vtp_rows(out: _Rows, sizes: tuple[int, ...], stage: int, tp_rank: int, M: int, act: int) -> None:
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
            out.add_total("pp", "send" if sending else "recv", "p2p", "forward", group, 2 * M, fwd * sending,
                          fwd * (not sending))
            out.add_total("pp", "recv" if sending else "send", "p2p", "backward", group, M, bwd * (not sending),
                          bwd * sending)
        if not direct:  # this stage receives through its leader: backward from the next, forward from the previous
            count, size = (M, bwd) if sending else (2 * M, fwd)
            out.add_total("pp", "broadcast", "p2p", "backward" if sending else "forward", t, count, size * leader,
                          size * (not leader))


def _grad_rows(out: _Rows, shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> None:
    e = opts.elem
    ep = dims.ep
    dense, expert = shape.rank_params(stage_tp(dims, stage), ep, dims.pp, stage)
    if ep == 1:
        dense, expert = dense + expert, 0
    if dims.dp_shard > 1:
        dense = hooked_params(shape, dims, opts, stage)  # FSDP2 owns the rest
    if dense:  # no bucket, no call
        out.add("dp", "all_reduce", "dp_cp_grads", "backward", dims.dp * dims.cp, 1, dense * e, dense * e)
    edp = dims.dp_replicate * dims.ep_borrow // ep
    if ep > 1 and expert:
        out.add("dp", "all_reduce", "expert_grads", "backward", edp, 1, expert * e, expert * e)


def _fsdp_rows(out: _Rows, shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> None:
    if dims.dp_shard == 1:
        return
    R, M, e = dims.dp_shard * dims.cp, opts.microbatches, opts.elem
    dense, expert = shape.rank_params(dims.tp, dims.ep, dims.pp, stage)
    owned = dense + (expert if dims.ep == 1 else 0) - hooked_params(shape, dims, opts, stage)
    layers = list(shape.stage_layers(dims.pp, stage))
    per_layer = [shape.layer_params(i, dims.tp, dims.ep) for i in layers]
    layer_owned = sum(d + (x if dims.ep == 1 else 0) for d, x in per_layer) - hooked_params(shape, dims, opts, stage)
    if opts.sequence_parallel and stage == dims.pp - 1:
        layer_owned += shape.hidden  # the final norm's hook is the root's, not a layer's
    G = len(layers) + 1
    full, layer_full, root = M * owned * e, M * layer_owned * e, (owned - layer_owned) * e
    root_f, root_b = _root_gathers(dims.pp, M, stage, opts.schedule)
    gathered_f, gathered_b = layer_full + root_f * root, layer_full + root_b * root
    out.add_total("fsdp", "all_gather_single", "fully_shard", "forward", R, M * (G - 1) + root_f, gathered_f // R,
                  gathered_f)
    out.add_total("fsdp", "all_gather_single", "fully_shard", "backward", R, M * (G - 1) + root_b, gathered_b // R,
                  gathered_b)
    out.add_total("fsdp", "reduce_scatter_single", "fully_shard", "backward", R, M * G, full, full // R)
    out.add_total("fsdp", "all_reduce", "fully_shard", "backward", dims.dp_replicate, M * G, full // R, full // R)


def _root_gathers(pp: int, M: int, stage: int, schedule: str) -> tuple[int, int]:
    """FSDP2 gathers of the root on a stage: (before a forward, before a backward).

    Layers are resharded after every forward and backward, so they are gathered once for each.
    The root is resharded after backward only: the step's first action gathers it, and so does
    each action that follows a backward. Stage ``stage``'s action order is the trainer's
    ``schedule`` table (1F1B or GPipe; plain gradient accumulation with ``pp`` 1: F B F B ...).
    """
    fwd = bwd = 0
    previous = "B"  # the root starts the step sharded
    for action in SCHEDULES[schedule if pp > 1 else "1f1b"](pp, M)[stage]:
        if previous == "B":
            fwd, bwd = (fwd + 1, bwd) if action.kind == "F" else (fwd, bwd + 1)
        previous = action.kind
    return fwd, bwd


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
        pipeline = r.op == "broadcast" or (r.op in ("send", "recv") and r.api != "ring_attention")
        api = "p2p" if pipeline else r.api
        key = (r.op, api, r.phase, r.group_size)
        c, s, v = table.get(key, (0, 0, 0))
        table[key] = (c + 1, s + r.bytes_sent, v + r.bytes_received)
    return table
