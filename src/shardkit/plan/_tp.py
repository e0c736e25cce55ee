"""The tensor-parallel rows of :func:`shardkit.plan.collectives.step_collectives` (Megatron f/g,
or sequence parallelism), per stage and microbatch; the rules are in that module's docstring."""

from __future__ import annotations

from .._rules import parse_ac
from ._rows import Rows
from ._tp_rings import ring_flags, ring_rows, stage_rings
from .model import ModelShape
from .options import StepOptions

__all__ = ["tp_rows"]


def tp_rows(
    out: Rows,
    shape: ModelShape,
    opts: StepOptions,
    layers: list[int],
    first: bool,
    last: bool,
    T: int,
    M: int,
    t: int,
    ep: int,
    *,
    sharded_boundaries: bool = False,
) -> None:
    """Add a stage's tp collectives to ``out``: ``layers`` of the stage, ``T`` tokens per
    microbatch on this rank, ``M`` microbatches, ``t`` tp ranks, ``ep`` expert-parallel ranks;
    ``sharded_boundaries``: with SP, pipeline stages exchange their sequence blocks."""
    e, H, n = opts.elem, shape.hidden, len(layers)
    full = T * H * e
    add = out.add
    if first:
        add("tp", "all_reduce", "all_reduce_forward", "forward", t, M, full, full)  # vocab-parallel embedding
    if shape.family in ("qwen3", "qwen3_moe"):
        add("tp", "all_reduce", "sum_grad_over", "backward", t, M * 2 * n, shape.head_dim * e, shape.head_dim * e)
    if shape.kv_heads < t and not shape.mla:  # replicated key/value heads: their weight gradients summed
        add(
            "tp",
            "all_reduce",
            "sum_grad_over",
            "backward",
            t,
            M * 2 * n,
            shape.head_dim * H * e,
            shape.head_dim * H * e,
        )
    for i in layers:  # column-parallel inputs inside a block, with or without SP (f: backward all-reduce)
        if shape.mla:  # kv_b_proj's input [T, kv_lora], the shared rope key [T, rope], q_b_proj's [T, q_lora]
            for width in (shape.kv_lora_rank, shape.qk_rope_dim) + ((shape.q_lora_rank,) if shape.q_lora_rank else ()):
                add("tp", "all_reduce", "all_reduce_backward", "backward", t, M, T * width * e, T * width * e)
        if shape.is_moe_layer(i) and ep == 1:  # tensor-parallel experts: the routing weights [T, k]
            add("tp", "all_reduce", "all_reduce_backward", "backward", t, M, T * shape.top_k * e, T * shape.top_k * e)
    if opts.sequence_parallel:
        ring = opts.async_tp
        _sp_rows(out, shape, layers, last, T, M, t, e, ep, ring, (first, sharded_boundaries))
        if opts.sp_activation == "shard":
            _regather_rows(out, shape, opts, layers, last, T, M, t, ep, ring)
        if ring:  # the collective-matmul rings (._tp_rings)
            ring_rows(out.add, stage_rings(shape, opts, layers, last, T, M, t, ep), t, T // t * H * e)
    else:
        _megatron_rows(out, shape, layers, last, T, M, t, e, ep)
    if last:
        if opts.loss_parallel:
            cdt = 4 if e < 4 else e
            width = (T + 2 * t + 8) * 8  # row maxima, widths, labels verdicts, 4 shared values as max and -min
            add("tp", "all_reduce", "vocab_parallel_cross_entropy", "forward", t, M, width, width)
            add(
                "tp",
                "all_reduce",
                "vocab_parallel_cross_entropy",
                "forward",
                t,
                M,
                (2 * T + 1) * cdt,
                (2 * T + 1) * cdt,
            )
        else:
            logits = T * shape.vocab * e
            add("tp", "all_gather_single", "gather_forward_split_backward", "forward", t, M, logits // t, logits)


def _sp_rows(
    out: Rows,
    shape: ModelShape,
    layers: list[int],
    last: bool,
    T: int,
    M: int,
    t: int,
    e: int,
    ep: int,
    ring: bool,
    ends: tuple[bool, bool] = (True, False),
) -> None:
    """tp with SP: every tensor-parallel region gathers its input ``[T/t, H] -> [T, H]`` and
    reduce-scatters its output; an expert-parallel MoE block runs on the local block (only its
    shared experts are a region) and its router's gradient is summed over tp. With ``ring``
    (async TP) only the collectives that are not rings (:func:`._tp_rings.ring_flags`) are here."""
    H, n = shape.hidden, len(layers)
    full, part = T * H * e, T // t * H * e
    gathers = scatters = routers = 0  # synchronous, per microbatch
    for i in layers:
        attn_ring, mlp_region, mlp_ring = ring_flags(shape, i, ep)
        gathers += 0 if ring and attn_ring else 1  # attention
        scatters += 0 if ring else 1  # o_proj
        if mlp_region and not (ring and mlp_ring):
            gathers, scatters = gathers + 1, scatters + 1  # dense MLP, tensor-parallel experts, shared experts
        if shape.is_moe_layer(i) and ep > 1:
            routers += 1
    heads = 0 if ring else last
    add = out.add
    add("tp", "all_gather_single", "all_gather", "forward", t, M * (gathers + heads), part, full)
    add("tp", "reduce_scatter_single", "all_gather", "backward", t, M * (gathers + heads), full, part)
    add("tp", "reduce_scatter_single", "reduce_scatter", "forward", t, M * scatters, full, part)
    add("tp", "all_gather_single", "reduce_scatter", "backward", t, M * scatters, part, full)
    add("tp", "all_reduce", "sum_grad_over", "backward", t, M * (2 * n + last), H * e, H * e)
    add("tp", "all_reduce", "sum_grad_over", "backward", t, M * routers, shape.experts * H * e, shape.experts * H * e)
    first, sharded = ends  # sequence-block boundaries: only the embedding's chunk splits, nothing gathers
    if first or not sharded:
        add("tp", "all_gather_single", "split_forward_gather_backward", "backward", t, M, part, full)
    if not last and not sharded:
        add("tp", "all_gather_single", "gather_forward_split_backward", "forward", t, M, part, full)


def _regather_rows(
    out: Rows,
    shape: ModelShape,
    opts: StepOptions,
    layers: list[int],
    last: bool,
    T: int,
    M: int,
    t: int,
    ep: int,
    ring: bool = False,
) -> None:
    """``sp_activation="shard"``: each gathered input read by column-parallel projections is
    gathered again in backward (:mod:`shardkit.tensor_parallel.sp_saved`): q/k/v (MLA: ``q_proj``
    without a q LoRA; its latent projections are replicated readers), gate/up (an MoE block's
    shared experts; routed experts are not column-parallel linears) and the head. A checkpointed
    block's readers take its recompute's gather instead, so with AC only the head regathers.
    ``selective`` keeps no result of these gathers (the replay leaves them out): its recompute
    issues every block's input gather again. With ``ring`` (async TP) only the synchronous
    gathers are here (the rings regather in ._tp_rings)."""
    mode, every = parse_ac(opts.activation_checkpoint)
    readers = regions = 0
    for j, i in enumerate(layers):  # selective:N checkpoints the stage's blocks N - 1, 2N - 1, ...
        attn_ring, mlp_region, mlp_ring = ring_flags(shape, i, ep)
        attn_ring, mlp_ring = attn_ring and ring, mlp_ring and ring
        if mode != "none" and (j + 1) % every == 0:
            regions += (not attn_ring) + (mlp_region and not mlp_ring)
            continue
        readers += 0 if (shape.mla and shape.q_lora_rank) or attn_ring else 1
        readers += 1 if (not shape.is_moe_layer(i) or shape.shared_experts) and not mlp_ring else 0
    e, H = opts.elem, shape.hidden
    part, full = T // t * H * e, T * H * e
    n = M * (readers + (last and not ring))
    out.add("tp", "all_gather_single", "sp_regather", "recompute", t, n, part, full)
    if mode == "selective":
        out.add("tp", "all_gather_single", "all_gather", "recompute", t, M * regions, part, full)


def _megatron_rows(
    out: Rows, shape: ModelShape, layers: list[int], last: bool, T: int, M: int, t: int, e: int, ep: int
) -> None:
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
            out.add(
                "tp",
                "all_gather_single",
                "split_forward_gather_backward",
                "backward",
                t,
                M,
                T // t * (H + k) * e,
                T * (H + k) * e,
            )
        else:  # tensor-parallel experts: partial outputs summed
            fwd, bwd = fwd + 1, bwd + 1
    out.add("tp", "all_reduce", "all_reduce_forward", "forward", t, M * fwd, full, full)
    out.add("tp", "all_reduce", "all_reduce_backward", "backward", t, M * (bwd + last), full, full)
