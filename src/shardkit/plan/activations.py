"""Activation bytes one decoder block keeps for backward, per rank, under each activation checkpointing mode.

The model counts the tensors shardkit's parallelized transformers decoder block (GQA attention
and a gated MLP: Llama, Qwen2) actually keeps, as
:class:`~shardkit.parallelize.saved_bytes.SavedBytesMeter` measures them (distinct storages,
parameters excluded); ``tests/plan/test_activations.py`` checks it against the meter at tp 1, 2
and 4, with and without sequence parallelism, Ulysses and Ring context parallelism, for ``none``,
``full`` and ``selective``. Per rank, with ``b`` rows of ``s = S / cp`` tokens (``T = b x s``),
``T_n = T / tp`` under sequence parallelism (else ``T``), ``n = N / tp`` query heads and
``k = max(1, N_kv / tp)`` key/value heads (replicated when ``N_kv < tp``), ``F = F_mlp / tp``:

* ``none`` (autograd's saved tensors): each RMSNorm keeps its input, the inverse RMS, the
  normalized output (``T_n`` tokens) and the matmul input after it (``T`` tokens: the
  sequence-parallel all-gather's output); the MLP keeps gate, up, ``silu(gate)`` and their
  product (``4 T F``); rotary cos and sin ``[1, s, D]``; attention keeps ``q`` and its output
  (``T n D`` each), ``k`` and ``v`` (``T k D`` each) and the log-sum-exp ``b n s``. Ulysses
  keeps its all-to-all's output (q, k and v for ``n / u`` heads of the whole sequence, the
  key/value heads replicated when fewer than ``u``), the key/value heads expanded to the query
  heads when the counts differ, and the output all-to-all's result.
* ``full``: only the block's inputs (hidden states ``T_n x H``, cos and sin, the position ids).
* ``selective`` (:data:`~shardkit.parallelize.checkpointing.SAVED_OPS`): the inputs, the
  outputs of the q, k, v, gate and up matmuls (the output projections are recomputed),
  attention's output and log-sum-exp, and every collective's result (the replay keeps them so
  the recompute does not communicate). Ring attention keeps ``cp + 1/2``
  block outputs on rank 0 (one per ring step, the zigzag's halves included: measured, constant
  over the tested sizes).

Under ``bfloat16`` the norms compute in float32 (transformers' RMSNorm) and the log-sum-exp is
float32, so those terms take 4 bytes. The figures are what one block holds at the end of its
forward; a checkpointed block's recompute briefly holds the ``none`` figure of one block in
backward, which :func:`~.memory.memory_per_rank` adds once. MoE and MLA blocks are counted with
the same attention and a top-k gated MLP of ``moe_ffn`` (an approximation: the token dispatch
buffers are not counted).

Source: the saved-tensor inventory of transformers' ``LlamaDecoderLayer`` with PyTorch's SDPA,
measured with ``torch.autograd.graph.saved_tensors_hooks``; compare Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022), whose ``34 s b h``
counts Megatron's block with dropout.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._rules import ac_rule, parse_ac
from ..errors import ShardkitError
from .model import ModelShape

__all__ = ["BlockLayout", "block_saved_bytes", "recompute_flops_per_token", "stage_saved_bytes"]

AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class BlockLayout:
    """What one rank of a decoder block sees: ``rows`` sequences of ``seq_len`` tokens (before
    context parallelism) over ``tp`` x ``cp_ulysses`` x ``cp_ring`` ranks."""

    rows: int
    seq_len: int
    tp: int = 1
    cp_ulysses: int = 1
    cp_ring: int = 1
    sequence_parallel: bool = False
    sp_activation: str = "shard"  # what the projections keep of the sequence all-gather (parallelize's default)


def _mlp_width(shape: ModelShape, tp: int) -> int:
    return -(-(shape.moe_ffn * shape.top_k if shape.experts else shape.ffn) // tp)


def block_saved_bytes(shape: ModelShape, where: BlockLayout, mode: str, elem: int) -> int:
    """Bytes one decoder block keeps for backward on one rank (see the module docstring).

    Args:
        shape: the model.
        where: rows, sequence length and the block's tensor / context parallel layout.
        mode: activation checkpointing, ``none``, ``full`` or ``selective``.
        elem: bytes per activation element (8 float64, 4 float32, 2 bfloat16).

    Returns:
        Bytes (an int).

    Uneven splits (sequence, heads, MLP width) count the fullest rank.

    Raises:
        ShardkitError: an unknown mode.
    """
    if mode not in AC_MODES:
        raise ShardkitError(f"plan: activation checkpointing must be one of {', '.join(AC_MODES)}, got {mode!r}")
    u, r, tp = where.cp_ulysses, where.cp_ring, where.tp
    e, wide = elem, max(elem, 4)
    s = -(-where.seq_len // (u * r))  # uneven splits: the fullest rank
    T = where.rows * s
    Tn = -(-T // tp) if where.sequence_parallel and tp > 1 else T
    n, k = -(-shape.heads // tp), max(1, shape.kv_heads // tp)
    H, D, F = shape.hidden, shape.head_dim, _mlp_width(shape, tp)
    # sp_activation="shard": the projections keep the norm's output block, not the all-gather's output
    sp_shard = where.sequence_parallel and tp > 1 and where.sp_activation == "shard"
    norm_out = Tn if sp_shard else T
    inputs = Tn * H * e + 2 * s * D * e + s * 8  # hidden states, cos and sin [1, s, D], int64 position ids
    # Ulysses: n / u query heads over the ring shard's s x u tokens; k / u key/value heads, one when fewer
    Sg, nu, ku = s * u, -(-n // u), (k // u if k >= u else 1)
    a2a = where.rows * Sg * D * (nu + 2 * ku) * e + T * n * D * e if u > 1 else 0
    attn_out = where.rows * Sg * nu * D * e + where.rows * nu * Sg * wide  # output and log-sum-exp
    if mode == "full":
        return inputs
    if mode == "selective":
        matmuls = T * (n + 2 * k) * D * e + 2 * T * F * e  # q, k, v; gate, up
        if r > 1:
            attn_out = attn_out * (2 * r + 1) // 2
        # the replay keeps each collective's result but for the shard layout's all-gathers (issued again)
        gathers = 0 if sp_shard else 2 * T * H * e
        tp_collectives = 0 if tp == 1 else gathers + (2 * Tn * H * e if where.sequence_parallel else 0)
        return inputs + matmuls + attn_out + tp_collectives + a2a
    norms = 2 * (Tn * H * (wide + e) + Tn * wide + norm_out * H * e)
    mlp = 4 * T * F * e
    rope = 2 * s * D * e
    if u > 1:
        # k and v expanded to the query heads; one cached int64 head index (nu entries) serves both
        expanded = 2 * where.rows * Sg * nu * D * e + nu * 8 if ku != nu else 0
        attention = a2a + expanded + attn_out
    else:
        attention = 2 * T * n * D * e + 2 * T * k * D * e + where.rows * n * s * wide
    return norms + mlp + rope + attention


def stage_saved_bytes(shape: ModelShape, where: BlockLayout, ac: str, elem: int, blocks: int) -> int:
    """Bytes ``blocks`` decoder blocks of one stage keep for backward on one rank under ``--ac ac``.

    The presets price every block alike (:func:`block_saved_bytes`); ``selective:N``
    (:func:`shardkit._rules.parse_ac`) checkpoints blocks ``N - 1, 2N - 1, ...`` of the stage
    whole (``full``) and the others keep everything (``none``), as
    :func:`shardkit.parallelize.checkpointing.apply_ac` does. Custom
    :class:`~shardkit.parallelize.ACPolicy` op lists are measured
    (:class:`~shardkit.parallelize.saved_bytes.SavedBytesMeter`), not priced.

    Raises:
        ShardkitError: an ``ac`` that ``shardkit train --ac`` refuses.
    """
    why = ac_rule(ac)
    if why is not None:
        raise ShardkitError(
            f"plan: activation checkpointing must be one of {', '.join(AC_MODES)} or selective:N ({why})"
        )
    mode, every = parse_ac(ac)
    checkpointed = blocks // every
    rest = (blocks - checkpointed) * block_saved_bytes(shape, where, "none", elem) if checkpointed < blocks else 0
    return checkpointed * block_saved_bytes(shape, where, mode, elem) + rest


def recompute_flops_per_token(shape: ModelShape, mode: str, seq_len: int) -> float:
    """FLOPs per token the backward spends recomputing checkpointed blocks: ``full`` one whole
    forward (a third of :meth:`~.model.ModelShape.flops_per_token`), ``selective`` the output
    projection ``o_proj`` (``2 N d_v H`` per layer; ``down_proj``'s recompute is cut short, see
    :mod:`shardkit.parallelize.checkpointing`), ``none`` 0; ``selective:N`` the whole forward of
    every N-th layer. Model FLOPs (and so MFU) leave it out.

    Raises:
        ShardkitError: an unknown mode.
    """
    why = ac_rule(mode)
    if why is not None:
        raise ShardkitError(
            f"plan: activation checkpointing must be one of {', '.join(AC_MODES)} or selective:N ({why})"
        )
    mode, every = parse_ac(mode)
    if mode == "full":
        return shape.flops_per_token(seq_len) / 3 * (shape.layers // every) / max(shape.layers, 1)
    if mode == "selective":
        return 2.0 * shape.layers * shape.heads * shape.v_dim * shape.hidden
    return 0.0
