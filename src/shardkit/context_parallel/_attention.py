"""Local (single-rank) attention on batch-first ``[B, S, N, D]`` tensors.

:func:`local_attention` runs torch's ``scaled_dot_product_attention`` (flash / memory-efficient
kernels where the device and mask allow) with grouped-query KV heads mapped by an explicit
index and packed documents isolated by a block-diagonal mask. :func:`attention_with_lse` is the
plain-math form that also returns the log-sum-exp of every query row, the quantity ring
attention merges partial results with.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

from ..comm._compat import sdpa

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["local_attention", "attention_with_lse", "document_mask"]


def document_mask(
    cu_seqlens: Sequence[int] | torch.Tensor, causal: bool, device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean ``[S, S]`` mask, True where query ``i`` may attend key ``j``: same document
    (block-diagonal over ``cu_seqlens``), and ``j <= i`` when ``causal``.

    Every token sees at least itself, so no row is fully masked. Built on ``device`` per call
    (not cached: it is ``S^2`` bytes, the size of one head's attention scores).
    """
    cu = torch.as_tensor(list(cu_seqlens), dtype=torch.int64, device=device)
    doc = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1])
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask = mask.tril()
    return mask


@functools.lru_cache(maxsize=64)
def _head_index(kv_index: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The int64 head index on ``device``, built once per head map and device: a tensor made
    from Python data is a blocking host-to-device copy, which every layer and step would pay."""
    return torch.tensor(kv_index, dtype=torch.int64, device=device)


def _expand_kv(t: torch.Tensor, kv_index) -> torch.Tensor:
    """Local KV heads -> one per query head (GQA). Autograd sums the gradient of shared heads."""
    if kv_index is None or tuple(kv_index) == tuple(range(t.shape[2])):
        return t
    return t.index_select(2, _head_index(tuple(int(i) for i in kv_index), t.device))


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    cu_seqlens: Sequence[int] | torch.Tensor | None = None,
    kv_index: Sequence[int] | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q`` over ``k, v`` on one rank, batch-first.

    Args:
        q: ``[B, S, n, D]``.
        k: ``[B, S, n_kv, D]``.
        v: ``[B, S, n_kv, Dv]``.
        causal: mask keys after the query position.
        scale: softmax scale; None for ``1 / sqrt(D)``.
        cu_seqlens: validated tuple of cumulative document lengths ending at ``S`` (tokens
            attend only within their document), or None.
        kv_index: the local KV head of each query head (``n`` ints), or None when ``n_kv == n``.

    Returns:
        ``[B, S, n, Dv]`` (a transposed view of SDPA's output).
    """
    k, v = _expand_kv(k, kv_index), _expand_kv(v, kv_index)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cu_seqlens is not None and len(cu_seqlens) > 2:
        mask = document_mask(cu_seqlens, causal, q.device)
        out = sdpa(qt, kt, vt, attn_mask=mask, scale=scale)
    else:
        out = sdpa(qt, kt, vt, is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-math attention returning ``(out [B, S_q, n, Dv], lse [B, n, S_q])``; lse in float32 or wider.

    ``q`` is ``[B, S_q, n, D]``, ``k`` ``[B, S_k, n, D]``, ``v`` ``[B, S_k, n, Dv]``. ``causal``
    aligns the last query with the last key (the convention of flash-attention for
    ``S_q != S_k``); ``mask`` is an extra boolean ``[S_q, S_k]`` (True = attend). A row with no
    visible key gets ``lse = -inf`` and a zero output, so merging it with other partial results
    is exact. Differentiable by autograd; O(S_q x S_k) memory.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bqnd,bknd->bnqk", q.to(acc), k.to(acc)) * scale
    s_q, s_k = q.shape[1], k.shape[1]
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep.tril(diagonal=s_k - s_q)
    if mask is not None:
        keep = keep & mask
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.einsum("bnqk,bknd->bqnd", probs, v.to(acc)).to(q.dtype)
    return out, lse
