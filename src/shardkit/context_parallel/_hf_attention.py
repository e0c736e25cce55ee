"""The attention functions :func:`~shardkit.context_parallel.apply_cp` registers with Hugging Face transformers.

transformers looks up ``config._attn_implementation`` in its ``AttentionInterface`` and calls
``fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)`` with
``query`` ``[B, N, S_r, D]`` and ``key``/``value`` ``[B, N_kv, S_r, D]`` (KV heads not repeated),
and expects ``([B, S_r, N, D], weights or None)`` back. The model's forward ``**kwargs`` reach
this call unchanged, so the per-batch facts (global length, packed documents) travel as one
keyword, :data:`KWARG`, that :meth:`CPBatch.inputs` adds; nothing is stored between calls, which
keeps gradient checkpointing (a second forward inside backward) right.

The causal mask: causality comes from the global positions inside the shardkit attention, so
the model must not build a mask of the *local* length. The shardkit names have no entry in
transformers' ``AttentionMaskInterface``, so ``create_causal_mask`` builds none and returns at
once, before it would probe ``position_ids`` for packed sequences (a device-to-host read per
forward, issue 29); a sliding window comes to the attention as the layer's ``sliding_window``
keyword and is applied there on global positions, as is Gemma 2's ``softcap``. transformers
would also drop a padding ``attention_mask`` without a word, so :func:`refuse_padding_masks`
hooks the model: a padding mask raises instead of being ignored (a prepared 4-D mask reaches
the attention, which raises).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import ShardkitError

__all__ = ["KWARG", "CPCall", "attention_name", "register", "refuse_padding_masks"]

#: The keyword the per-batch context travels under, from ``model(**batch.inputs)`` to the attention.
KWARG = "shardkit_cp"
_UNSUPPORTED = ("s_aux", "position_bias")


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
        bad = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
        if bad:
            raise ShardkitError(f"{op}: attention arguments {bad} are not supported under context parallelism")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # HF [B, N, S, D] -> shardkit [B, S, N, D]
        # The layer's own variants: Qwen2/3, Mistral and Gemma 2 pass sliding_window (HF's W, keys
        # i - W < j <= i) on their sliding layers, Gemma 2 its attn_logit_softcapping as softcap.
        variants = {name: kwargs.get(name) for name in ("sliding_window", "softcap")}
        out = call.context._attend(
            q, k, v, causal=causal, scale=scaling, seq_len=call.seq_len, cu_seqlens=call.cu_seqlens, **variants
        )
        return out, None

    attention.__name__ = attention.__qualname__ = op.replace("-", "_")
    return attention


_FUNCTIONS = {mode: _make(mode) for mode in ("ulysses", "ring", "usp")}


_PADDING = (
    "apply_cp: attention_mask (padding) is not supported under context parallelism; "
    "pack documents and pass cu_seqlens= to shard_batch instead"
)


def _mask_hook(position: int | None):
    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and position is not None and len(args) > position:
            mask = args[position]
        if mask is not None:  # the model's argument: the same verdict on every rank
            raise ShardkitError(_PADDING)

    return hook


def refuse_padding_masks(model: nn.Module) -> None:
    """Raise on a padding ``attention_mask`` given to ``model`` (or to its base model), which
    transformers would drop without a word for an implementation without a mask function.
    One forward pre-hook per module (idempotent)."""
    for m in {id(x): x for x in (model, getattr(model, "base_model", None)) if isinstance(x, nn.Module)}.values():
        if getattr(m, "_shardkit_cp_mask_hook", None) is not None:
            continue
        names = list(inspect.signature(m.forward).parameters)
        position = names.index("attention_mask") if "attention_mask" in names else None
        setattr(m, "_shardkit_cp_mask_hook", m.register_forward_pre_hook(_mask_hook(position), with_kwargs=True))


def register(mode: str) -> str:
    """Register the attention function of ``mode`` with transformers (idempotent; no mask
    function: see the module docstring). Returns the registered name."""
    from transformers import AttentionInterface

    name = attention_name(mode)
    AttentionInterface.register(name, _FUNCTIONS[mode])
    return name
