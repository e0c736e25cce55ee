"""The attention functions :func:`~shardkit.context_parallel.apply_cp` registers with Hugging Face transformers.

transformers looks up ``config._attn_implementation`` in its ``AttentionInterface`` and calls
``fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)`` with
``query`` ``[B, N, S_r, D]`` and ``key``/``value`` ``[B, N_kv, S_r, D]`` (KV heads not repeated),
and expects ``([B, S_r, N, D], weights or None)`` back. The model's forward ``**kwargs`` reach
this call unchanged, so the per-batch facts (global length, packed documents) travel as one
keyword, :data:`KWARG`, that :meth:`CPBatch.inputs` adds; nothing is stored between calls, which
keeps gradient checkpointing (a second forward inside backward) right.

The causal mask: causality comes from the global positions inside the shardkit attention, so
the model must not build a mask of the *local* length. transformers would build none for an
implementation missing from its ``AttentionMaskInterface``, but it would also drop a padding
``attention_mask`` without a word (``create_causal_mask`` returns None). So :func:`register`
also registers a mask function for the name: it returns None (no ``[S, S]`` mask is ever
made) and raises on a padding mask instead of ignoring it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ShardkitError

__all__ = ["KWARG", "CPCall", "attention_name", "register"]

#: The keyword the per-batch context travels under, from ``model(**batch.inputs)`` to the attention.
KWARG = "shardkit_cp"
_UNSUPPORTED = ("softcap", "s_aux", "position_bias")


@dataclass(frozen=True)
class CPCall:
    """Per-batch facts the attention needs: the context (mode, groups), global ``S`` and the global ``cu_seqlens``."""

    context: Any
    seq_len: int
    cu_seqlens: tuple[int, ...] | None


def attention_name(mode: str) -> str:
    return f"shardkit_cp_{mode}"


def _make(mode: str):
    op = attention_name(mode)

    def attention(
        module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
    ):
        call = kwargs.get(KWARG)
        if not isinstance(call, CPCall):
            raise ShardkitError(
                f"{op}: the model was called without the context-parallel batch; call it as model(**batch.inputs) "
                f"with batch = ctx.shard_batch(...) (keyword {KWARG!r} missing)"
            )
        if call.context.mode != mode:
            raise ShardkitError(f"{op}: the batch was sharded for mode {call.context.mode!r}, not {mode!r}")
        # Every check below reads the config, the module's mode or the batch: the same on every rank.
        if attention_mask is not None:
            raise ShardkitError(
                f"{op}: attention_mask is not supported under context parallelism (padding masks are local); "
                "pack documents and pass cu_seqlens= to shard_batch instead"
            )
        if dropout:
            raise ShardkitError(
                f"{op}: attention dropout is not supported (got dropout={dropout} in training); set attention_dropout=0"
            )
        window = kwargs.get("sliding_window")
        if window is not None and call.seq_len > window:
            raise ShardkitError(
                f"{op}: sliding-window attention is not supported (window {window} < S = {call.seq_len})"
            )
        bad = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
        if bad:
            raise ShardkitError(f"{op}: attention arguments {bad} are not supported under context parallelism")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # HF [B, N, S, D] -> shardkit [B, S, N, D]
        out = call.context._attend(
            q, k, v, causal=causal, scale=scaling, seq_len=call.seq_len, cu_seqlens=call.cu_seqlens
        )
        return out, None

    attention.__name__ = attention.__qualname__ = op.replace("-", "_")
    return attention


_FUNCTIONS = {mode: _make(mode) for mode in ("ulysses", "ring", "usp")}


def _no_mask(*args, attention_mask=None, **kwargs):
    """transformers' mask hook for the shardkit names: never a mask; a padding mask is an error, not ignored."""
    if attention_mask is not None:
        raise ShardkitError(
            "apply_cp: attention_mask (padding) is not supported under context parallelism; "
            "pack documents and pass cu_seqlens= to shard_batch instead"
        )
    return None


def register(mode: str) -> str:
    """Register the attention function of ``mode`` and its mask function with transformers (idempotent).

    Returns the registered name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = attention_name(mode)
    AttentionInterface.register(name, _FUNCTIONS[mode])
    AttentionMaskInterface.register(name, _no_mask)
    return name
