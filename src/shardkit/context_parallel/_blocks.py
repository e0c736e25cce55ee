"""Block attention with log-sum-exp for ring attention: forward, backward and the merge rule.

A block is one (query tile, key tile) pair. Three kinds: fully visible (``causal=False``),
diagonal (the same chunk on both sides, square, ``causal=True``) and, for packed documents whose
small parts share a tile, an explicit boolean ``mask`` (True = attend). On CPU they run torch's
fused flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; it
returns the log-sum-exp, takes an additive mask and needs ``Dv == D``); elsewhere a plain-math
path. The kernel reports ``lse = 0`` for a row the mask hides entirely; such rows are set to
``-inf`` here so that merging them contributes nothing.

The backward of a block needs the *final* output and log-sum-exp of its query rows (flash
attention's recomputation): ``P = exp(scale * Q K^T - lse)`` is then the block's slice of the
global softmax, and ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` over the full row.
Source: Dao et al., "FlashAttention" (2022), Algorithm 2; Milakov & Gimelshein, "Online
normalizer calculation for softmax" (2018) for the merge.
"""

from __future__ import annotations

import torch

__all__ = ["block_forward", "block_backward", "merge", "acc_dtype"]

_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of merges and gradient buffers: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _use_flash(q: torch.Tensor, v: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and q.dtype in _FLASH_DTYPES


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``N_kv`` heads -> ``N`` (query head ``h`` uses KV head ``h // rep``)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=2)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Adjoint of :func:`_expand`: sum the gradients of each KV head's query group."""
    if rep == 1:
        return t
    b, s, n, d = t.shape
    return t.reshape(b, s, n // rep, rep, d).sum(3)


def _scores(q, k, causal: bool, scale: float, mask=None) -> torch.Tensor:
    acc = acc_dtype(q.dtype)
    s = torch.einsum("bqnd,bknd->bnqk", q.to(acc), k.to(acc)) * scale
    if causal:  # square diagonal block: query i sees keys 0..i
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _additive(mask, dtype):
    """Boolean ``[Sq, Sk]`` mask -> the additive form the fused kernel takes (0 or -inf)."""
    return (
        None
        if mask is None
        else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    )


def block_forward(q, k, v, causal: bool, scale: float, rep: int, mask=None):
    """``q [B, Sq, N, D]``, ``k [B, Sk, N_kv, D]``, ``v [B, Sk, N_kv, Dv]`` -> ``(out [B, Sq, N, Dv], lse [B, Sq, N])``.

    ``mask``: optional boolean ``[Sq, Sk]`` (True = attend). A row it hides entirely gets
    ``lse = -inf`` and a zero output. ``out`` is in ``q.dtype`` (flash) or the accumulation
    dtype (math); ``lse`` in the accumulation dtype.
    """
    k, v = _expand(k, rep), _expand(v, rep)
    if _use_flash(q, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            0.0,
            causal,
            attn_mask=_additive(mask, q.dtype),
            scale=scale,
        )
        out, lse = out.transpose(1, 2), lse.transpose(1, 2).to(acc_dtype(q.dtype))
        if mask is not None:
            empty = ~mask.any(-1)[None, :, None]  # [1, Sq, 1]
            out, lse = out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))
        return out, lse
    s = _scores(q, k, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return torch.einsum("bnqk,bknd->bqnd", p, v.to(s.dtype)), lse.transpose(1, 2)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, rep: int, mask=None):
    """Gradients of one block given the final ``out`` (``q.dtype``) and ``lse [B, Sq, N]`` of its rows.

    ``mask`` as in :func:`block_forward`; the final ``lse`` is finite (every token sees itself).

    Returns ``(dq [B, Sq, N, D], dk [B, Sk, N_kv, D], dv [B, Sk, N_kv, Dv])`` in the accumulation dtype.
    """
    acc = acc_dtype(q.dtype)
    ke, ve = _expand(k, rep), _expand(v, rep)
    if _use_flash(q, ve):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout),
            t(q),
            t(ke),
            t(ve),
            t(out),
            t(lse).to(q.dtype if q.dtype == torch.float64 else torch.float32).contiguous(),
            0.0,
            causal,
            attn_mask=_additive(mask, q.dtype),
            scale=scale,
        )
        dq, dk, dv = t(dq).to(acc), t(dk).to(acc), t(dv).to(acc)
    else:
        s = _scores(q, ke, causal, scale, mask)
        p = torch.exp(s - lse.transpose(1, 2)[..., None])
        do = dout.to(acc)
        dv = torch.einsum("bnqk,bqnd->bknd", p, do)
        dp = torch.einsum("bqnd,bknd->bnqk", do, ve.to(acc))
        delta = (do * out.to(acc)).sum(-1).transpose(1, 2)  # [B, N, Sq]
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("bnqk,bknd->bqnd", ds, ke.to(acc)) * scale
        dk = torch.einsum("bnqk,bqnd->bknd", ds, q.to(acc)) * scale
    return dq, _fold(dk, rep), _fold(dv, rep)


def merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a block result into the running ``(out_acc [B, Sq, N, Dv], lse_acc [B, Sq, N])`` in place.

    Online softmax: ``lse = logaddexp(lse_acc, lse_b)``; ``out = out_acc e^(lse_acc - lse) + out_b e^(lse_b - lse)``.
    A row still at ``-inf`` (nothing seen yet) keeps a zero output instead of NaN.
    """
    new = torch.logaddexp(lse_acc, lse_b)
    safe = new.masked_fill(torch.isinf(new), 0.0)
    out_acc.mul_(torch.exp(lse_acc - safe)[..., None]).add_(
        out_b.to(out_acc.dtype) * torch.exp(lse_b - safe)[..., None]
    )
    lse_acc.copy_(new)
