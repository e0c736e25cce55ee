"""Async tensor parallelism in the planner: the collective-matmul rings of a stage
(:mod:`shardkit.comm.collective_matmul`), their ledger rows, and the seconds they leave exposed.

With ``async_tp`` the runtime issues a sequence-parallel region's input all-gather as a ring of
``t - 1`` steps inside its column-parallel readers' matmuls (q/k/v together, gate/up together,
the head), and its row-parallel output's reduce-scatter as a ring inside that matmul. Per
microbatch and ring, each step moves one block ``[T / t, H]`` to the next rank while the matmul
of one block runs. Backward: the gather ring's input gradient is a reduce-scatter ring (the same
matmul per block), its weight gradients a regather ring of the kept shard (``sp_activation=
"shard"``; not where a checkpoint's recompute gathered it: the runtime hands that gather to the
original node); the reduce-scatter ring's backward is a gather ring computing the input- and
weight-gradient blocks (twice the forward's matmul). A checkpointed block's recompute runs its
rings again (point-to-point calls are never replayed). Gathers without column-parallel readers
(an MoE block of tensor-parallel experts, MLA's attention with a query LoRA) and that MoE
block's output reduce-scatter stay synchronous collectives.

Exposed time: a ring's transfer ``s`` runs beside the matmul of block ``s`` (gather: its own
block first; reduce-scatter: the next destination's partial), and the ring's last matmul (gather)
or first (reduce-scatter) has no transfer beside it. So a ring of step transfer ``c`` (alpha-beta,
one block) and step matmul ``m`` leaves ``(t - 1) max(0, c - m)`` seconds of communication on
the critical path; no step is unoverlapped on the communication side.

Source: Wang et al., ASPLOS 2023 (decomposition of a collective into ``t - 1`` dependent steps
overlapping the partial matmuls); the runtime's rings.
"""

from __future__ import annotations

from typing import NamedTuple

from .._rules import parse_ac
from .model import ModelShape
from .options import StepOptions

__all__ = ["Ring", "stage_rings", "ring_rows", "rings_exposed_seconds", "ring_flags"]


class Ring(NamedTuple):
    """``calls`` rings per step of one kind: ledger api and phase, and the matmul FLOPs of one block."""

    api: str
    phase: str
    calls: int
    flops: float


def ring_flags(shape: ModelShape, i: int, ep: int) -> tuple[bool, bool, bool]:
    """Layer ``i``'s (attention gather is a ring, MLP region exists, MLP region is ring-able)."""
    attn_ring = not (shape.mla and shape.q_lora_rank)
    mlp_region = not shape.is_moe_layer(i) or ep == 1 or bool(shape.shared_experts)
    mlp_ring = not shape.is_moe_layer(i) or (ep > 1 and bool(shape.shared_experts))
    return attn_ring, mlp_region, mlp_ring


def stage_rings(
    shape: ModelShape, opts: StepOptions, layers: list[int], last: bool, T: int, M: int, t: int, ep: int
) -> list[Ring]:
    """Every collective-matmul ring of a stage's step (module docstring), with ``T`` tokens per
    microbatch, ``M`` microbatches, ``t`` tp ranks."""
    H, b = shape.hidden, T // t  # one block's rows
    shard = opts.sp_activation == "shard"
    mode, every = parse_ac(opts.activation_checkpoint)
    out: list[Ring] = []

    def gather(width: int, checkpointed: bool) -> None:
        f = 2.0 * b * H * width / t
        out.extend([Ring("all_gather_matmul", "forward", M, f), Ring("all_gather_matmul", "backward", M, f)])
        if checkpointed:
            out.append(Ring("all_gather_matmul", "recompute", M, f))
        elif shard:
            out.append(Ring("sp_regather", "recompute", M, f))

    def scatter(width: int, checkpointed: bool) -> None:
        f = 2.0 * b * H * width / t
        out.extend(
            [Ring("matmul_reduce_scatter", "forward", M, f), Ring("matmul_reduce_scatter", "backward", M, 2 * f)]
        )
        if checkpointed:
            out.append(Ring("matmul_reduce_scatter", "recompute", M, f))

    for j, i in enumerate(layers):
        ckpt = mode != "none" and (j + 1) % every == 0
        attn_ring, _, mlp_ring = ring_flags(shape, i, ep)
        if attn_ring:
            q = shape.heads * shape.qk_dim
            gather(q if shape.mla else (shape.heads + 2 * shape.kv_heads) * shape.head_dim, ckpt)
        scatter(shape.heads * shape.v_dim, ckpt)
        if mlp_ring:
            ffn = shape.ffn if not shape.is_moe_layer(i) else shape.moe_ffn * shape.shared_experts
            gather(2 * ffn, ckpt)
            scatter(ffn, ckpt)
    if last:
        gather(shape.vocab, False)
    return out


def ring_rows(add, rings: list[Ring], t: int, part: int) -> None:
    """Add the rings' ledger rows through ``add`` (:meth:`~._rows.Rows.add`): per ring ``t - 1``
    sends and receives of one block of ``part`` bytes."""
    for r in rings:
        add("tp", "send", r.api, r.phase, t, r.calls * (t - 1), part, 0)
        add("tp", "recv", r.api, r.phase, t, r.calls * (t - 1), 0, part)


def rings_exposed_seconds(rings: list[Ring], t: int, step_s: float, flops_per_s: float) -> float:
    """Seconds of the rings' communication on the critical path: ``(t - 1) max(0, c - m)`` per
    ring, ``c = step_s`` one block's transfer, ``m`` one block's matmul (pure)."""
    return sum(r.calls * (t - 1) * max(0.0, step_s - r.flops / flops_per_s) for r in rings)
