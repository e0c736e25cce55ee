"""The trainer's attention: transformers' SDPA without the mask builder's per-forward device read.

transformers' ``create_causal_mask`` looks for packed sequences in every forward: it compares
consecutive ``position_ids`` and reads the answer on the host
(``masking_utils.find_packed_sequence_indices``), one device-to-host read per model forward (per
pipeline chunk), although the trainer knows its documents on the host before the step (issue 29).

The trainer therefore runs its decoders under :data:`NAME`, transformers' own
``sdpa_attention_forward`` registered under a name that has no entry in transformers'
``AttentionMaskInterface``: ``create_causal_mask`` then builds no mask and never inspects
``position_ids``; the attention gets ``attention_mask=None`` and calls SDPA with
``is_causal=True``, the very call transformers makes for an unpacked causal batch (it skips the
mask there too). Packed rows (``--packed`` without cp) bring their block-causal mask themselves
(:func:`packed_causal_mask`), built on the device from the documents the sampler drew on the
host: a 4-D mask reaches the attention unchanged, the same boolean mask transformers would build
from the restarting positions. Logits are bitwise those of ``"sdpa"`` (tests/train/test_attention.py).
transformers hands a ready 4-D mask to *every* layer kind as it is, so a model with a sliding
window gets its window in the mask too (:func:`packed_attention_mask`): one banded mask when every
layer slides, a ``{layer type: mask}`` mapping (transformers' own per-kind form) when the kinds
mix; a plain block-causal mask there would let each token see its whole document
(tests/train/test_packed_sliding_window.py).

Only a model running ``"sdpa"`` with causal, full attention in every layer switches: a sliding
window (or any other layer kind) needs transformers' mask builder and keeps ``"sdpa"``. The
trainer never passes a padding mask (the name would drop a 2-D one, as for any implementation
without a mask function).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..comm.host_sync import host_side, to_device
from ..errors import ShardkitError

__all__ = ["NAME", "mask_free_sdpa", "packed_causal_mask", "packed_attention_mask"]

#: The attention implementation the trainer's decoders run (transformers' SDPA, no mask builder).
NAME = "shardkit_sdpa"


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(NAME, sdpa_attention_forward)  # idempotent: a dict entry


def _full_causal(config) -> bool:
    """Every layer causal full attention (no sliding window, no other layer kind)."""
    if not getattr(config, "is_causal", True):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(config, "sliding_window", None) is None


def mask_free_sdpa(model: nn.Module) -> bool:
    """Switch a transformers decoder running ``"sdpa"`` with full causal attention to :data:`NAME`.

    Returns whether it switched (False: another implementation or a sliding window; the model
    is left as it is). The model then builds no causal mask: call it without a padding mask, and
    give packed rows :func:`packed_causal_mask` as ``attention_mask``.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or not _full_causal(config):
        return False
    _register()
    hf: object = model
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(NAME)
    else:
        config._attn_implementation = NAME
    return config._attn_implementation == NAME


def packed_causal_mask(cus: Sequence[Sequence[int]], seq_len: int, device) -> torch.Tensor:
    """``[b, 1, S, S]`` boolean mask of packed rows: query ``q`` sees key ``k <= q`` of its own document.

    ``cus[r]``: the cumulative document lengths of row ``r`` (host data). The document index of
    every token is built on the host and copied without blocking (:func:`~shardkit.comm.host_sync.to_device`);
    the mask itself is computed on ``device``. It equals the mask transformers builds from
    positions that restart at every document (``True`` = attend).
    """
    with host_side():  # the sampler's document borders
        docs = torch.zeros(len(cus), seq_len, dtype=torch.int32)
        for r, cu in enumerate(cus):
            for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
                docs[r, a:b] = d
    doc = to_device(docs, device)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def _window_kinds(config) -> tuple[int | None, list[str] | None]:
    """``(sliding window, layer types)`` of a transformers config: window None when no layer slides;
    types None when every layer is the same kind (no ``layer_types``, or one kind only)."""
    window = getattr(config, "sliding_window", None) if config is not None else None
    types = getattr(config, "layer_types", None) if window is not None else None
    if types is not None and "sliding_attention" not in types:
        return None, None  # a window size but no sliding layer (Qwen2's max_window_layers)
    if types is not None and set(types) == {"sliding_attention"}:
        types = None
    return window, types


def packed_attention_mask(
    cus: Sequence[Sequence[int]], seq_len: int, device, config=None
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` of packed rows for a model with ``config`` (its sliding window kept).

    :func:`packed_causal_mask` (``[b, 1, S, S]`` boolean) when no layer slides; the same mask
    with the band ``q - k < W`` (transformers' ``sliding_window_overlay``, ``W`` the config's
    ``sliding_window``) when every layer slides (``layer_types`` all sliding, or a
    ``sliding_window`` without ``layer_types``, as Qwen3-MoE); ``{"full_attention": causal,
    "sliding_attention": banded}`` when the layer kinds mix (Qwen2 / Qwen3 ``layer_types``: the
    per-kind mapping their forward takes as ``attention_mask``).

    Raises:
        ShardkitError: a layer kind other than full and sliding attention (no mask for it here).
    """
    mask = packed_causal_mask(cus, seq_len, device)
    window, types = _window_kinds(config)
    if window is None:
        return mask
    q = torch.arange(seq_len, device=mask.device)
    banded = mask & (q[:, None] - q[None, :] < window)
    if types is None:
        return banded
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise ShardkitError(f"packed rows: no packed mask for layer types {other} (full and sliding attention only)")
    return {"full_attention": mask, "sliding_attention": banded}
