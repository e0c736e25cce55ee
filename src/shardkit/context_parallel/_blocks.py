"""Block attention with log-sum-exp for ring attention: forward, backward and the merge rule.

A block is one (query tile, key tile) pair. Three kinds: fully visible (``causal=False``),
diagonal (the same chunk on both sides, square, ``causal=True``) and, for packed documents whose
small parts share a tile, an explicit boolean ``mask`` (True = attend).

Each block runs a fused kernel that returns the log-sum-exp, the ones torch's own
``context_parallel`` merges (:func:`block_kernel` picks it):

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype, additive mask);
* CUDA: FlashAttention-2 (``aten._scaled_dot_product_flash_attention``: float16/bfloat16, no
  mask, ``D <= 256``, ``D % 8 == 0``, sm80 or newer), else the memory-efficient kernel
  (``aten._scaled_dot_product_efficient_attention``: float32 too, an additive bias for masked
  tiles; its lse rows are padded to a multiple of 32).

Both need ``Dv == D``. Where no fused kernel accepts the inputs (``Dv != D``, float64 on CUDA, a
head dim the kernels refuse, another device, a logit ``softcap``, which no SDPA kernel applies)
a plain-math path materializes the block's ``[B, N, Sq, Sk]`` scores in the accumulation dtype,
and says so once per call site. A fused kernel reports ``lse = 0`` (CPU) or ``-inf`` for a row
the mask hides entirely; such rows are set to ``-inf`` and a zero output here so that merging them contributes nothing.

The backward of a block needs the *final* output and log-sum-exp of its query rows (flash
attention's recomputation): ``P = exp(scale * Q K^T - lse)`` is then the block's slice of the
global softmax, and ``dS = P * (dP - delta)`` with ``delta = rowsum(dO * O)`` over the full row.
Source: Dao et al., "FlashAttention" (2022), Algorithm 2; Milakov & Gimelshein, "Online
normalizer calculation for softmax" (2018) for the merge.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["block_forward", "block_backward", "block_kernel", "merge", "acc_dtype"]

_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_CUDA_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_CUDA_EFFICIENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The memory-efficient kernel reads an additive bias whose rows start on 16-element boundaries
# and writes lse rows padded to a multiple of 32 (torch's SDPA pads the same way).
_BIAS_ALIGN, _LSE_ALIGN = 16, 32


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of merges and gradient buffers: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _flash_capable(device: torch.device) -> bool:
    """FlashAttention-2 needs sm80+; a CUDA device that torch cannot query (a fake tensor on a
    CPU build, which runs the kernels' meta functions) is taken as capable."""
    if not torch.backends.cuda.flash_sdp_enabled():
        return False
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


def block_kernel(q: torch.Tensor, v: torch.Tensor, masked: bool, softcap: float | None = None) -> str:
    """The kernel a block of ``q [B, Sq, N, D]`` against ``v [B, Sk, N, Dv]`` runs.

    Returns ``"cpu_flash"``, ``"flash"``, ``"efficient"`` or ``"math"`` (module docstring). The
    choice is a pure function of device, dtype, head dims, ``masked`` and ``softcap``, the same on
    every rank of a ring. Warns once per call site when a block falls back to the math path on
    CUDA, or for a softcap on any device.
    """
    d, dv = q.shape[-1], v.shape[-1]
    if softcap is not None:
        warnings.warn(
            "context-parallel attention: no fused SDPA kernel applies a logit softcap; the blocks run the math "
            "path (O(Sq x Sk) memory per block)",
            stacklevel=3,
        )
        return "math"
    if q.device.type == "cpu":
        return "cpu_flash" if d == dv and q.dtype in _CPU_DTYPES else "math"
    if q.device.type == "cuda" and d == dv and d % 8 == 0:
        if not masked and q.dtype in _CUDA_FLASH_DTYPES and d <= 256 and _flash_capable(q.device):
            return "flash"
        if q.dtype in _CUDA_EFFICIENT_DTYPES and torch.backends.cuda.mem_efficient_sdp_enabled():
            return "efficient"
    if q.device.type == "cuda":
        warnings.warn(
            f"ring attention: no fused CUDA kernel takes {q.dtype} with D = {d}, Dv = {dv}; the blocks run "
            "the math path (O(Sq x Sk) memory per block); use bfloat16/float16/float32 with Dv == D, D % 8 == 0",
            stacklevel=3,
        )
    return "math"


def _padded(t: torch.Tensor, align: int) -> torch.Tensor:
    """``t`` with its last dim zero-padded to a multiple of ``align`` (no copy when it is one)."""
    pad = -t.shape[-1] % align
    return t if pad == 0 else torch.nn.functional.pad(t, (0, pad))


def _bias(mask, dtype):
    """Boolean ``[Sq, Sk]`` mask -> the memory-efficient kernel's additive bias (0 or -inf),
    ``[Sq, Sk]`` viewed out of rows padded to :data:`_BIAS_ALIGN` elements."""
    if mask is None:
        return None
    return _padded(_additive(mask, dtype), _BIAS_ALIGN).narrow(-1, 0, mask.shape[-1])


def _hide_empty_rows(out, lse, mask):
    """Rows the mask hides entirely: zero output, ``lse = -inf`` (``out [B, Sq, N, Dv]``, ``lse [B, Sq, N]``)."""
    if mask is None:
        return out, lse
    empty = mask.any(-1).logical_not().view(1, -1, 1)  # [1, Sq, 1]
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    """``N_kv`` heads -> ``N`` (query head ``h`` uses KV head ``h // rep``)."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=2)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Adjoint of :func:`_expand`: sum the gradients of each KV head's query group."""
    if rep == 1:
        return t
    b, s, n, d = t.shape
    return t.reshape(b, s, n // rep, rep, d).sum(3)


def _scores(q, k, causal: bool, scale: float, mask=None, softcap=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked scores ``[B, N, Sq, Sk]`` and, with ``softcap``, ``tanh`` of the scaled scores over
    the cap (the backward's chain factor ``1 - tanh^2``): Gemma 2 caps before the mask."""
    acc = acc_dtype(q.dtype)
    s = torch.einsum("bqnd,bknd->bnqk", q.to(acc), k.to(acc)) * scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    if causal:  # square diagonal block: query i sees keys 0..i
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(keep.logical_not(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask.logical_not(), float("-inf"))
    return s, tanh


def _additive(mask, dtype):
    """Boolean ``[Sq, Sk]`` mask -> the additive form the fused kernel takes (0 or -inf)."""
    return (
        None
        if mask is None
        else torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), float("-inf"))
    )


def block_forward(q, k, v, causal: bool, scale: float, rep: int, mask=None, softcap=None):
    """``q [B, Sq, N, D]``, ``k [B, Sk, N_kv, D]``, ``v [B, Sk, N_kv, Dv]`` -> ``(out [B, Sq, N, Dv], lse [B, Sq, N])``.

    ``mask``: optional boolean ``[Sq, Sk]`` (True = attend). A row it hides entirely gets
    ``lse = -inf`` and a zero output. ``softcap``: ``softcap * tanh(scores / softcap)`` on the
    scaled scores before the mask (math path). ``out`` is in ``q.dtype`` (flash) or the
    accumulation dtype (math); ``lse`` in the accumulation dtype.
    """
    k, v = _expand(k, rep), _expand(v, rep)
    kernel = block_kernel(q, v, mask is not None, softcap)
    if kernel != "math":
        t = lambda x: x.transpose(1, 2)  # noqa: E731  [B, S, N, D] <-> the kernels' [B, N, S, D]
        if kernel == "cpu_flash":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                t(q), t(k), t(v), 0.0, causal, attn_mask=_additive(mask, q.dtype), scale=scale
            )
        elif kernel == "flash":
            flash = torch.ops.aten._scaled_dot_product_flash_attention
            out, lse = flash(t(q), t(k), t(v), 0.0, causal, scale=scale)[:2]
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                t(q), t(k), t(v), _bias(mask, q.dtype), True, 0.0, causal, scale=scale
            )[:2]
            lse = lse.narrow(2, 0, q.shape[1])  # rows padded to a multiple of 32
        return _hide_empty_rows(t(out), t(lse).to(acc_dtype(q.dtype)), mask)
    s, _ = _scores(q, k, causal, scale, mask, softcap)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
    return torch.einsum("bnqk,bknd->bqnd", p, v.to(s.dtype)), lse.transpose(1, 2)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, rep: int, mask=None, softcap=None):
    """Gradients of one block given the final ``out`` (``q.dtype``) and ``lse [B, Sq, N]`` of its rows.

    ``mask``, ``softcap`` as in :func:`block_forward`; the final ``lse`` is finite (every token
    sees itself). With a softcap the score gradient is scaled by ``1 - tanh^2`` (the cap's
    derivative) before it reaches ``q`` and ``k``.

    Returns ``(dq [B, Sq, N, D], dk [B, Sk, N_kv, D], dv [B, Sk, N_kv, Dv])`` in the accumulation dtype.
    """
    acc = acc_dtype(q.dtype)
    ke, ve = _expand(k, rep), _expand(v, rep)
    kernel = block_kernel(q, ve, mask is not None, softcap)
    if kernel != "math":
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        lse_t = t(lse)  # [B, N, Sq]
        if kernel == "cpu_flash":
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                t(dout),
                t(q),
                t(ke),
                t(ve),
                t(out),
                lse_t.to(q.dtype if q.dtype == torch.float64 else torch.float32).contiguous(),
                0.0,
                causal,
                attn_mask=_additive(mask, q.dtype),
                scale=scale,
            )
        elif kernel == "flash":
            # Dropout is off, so the kernel reads no RNG state: empty seed/offset stand in.
            rng = q.new_empty((2,), dtype=torch.int64), q.new_empty((), dtype=torch.int64)
            grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                t(dout),
                t(q),
                t(ke),
                t(ve),
                t(out),
                lse_t.float().clone(memory_format=torch.contiguous_format),
                None,
                None,
                q.shape[1],
                ke.shape[1],
                0.0,
                causal,
                *rng,
                scale=scale,
            )
        else:
            rng = q.new_empty((), dtype=torch.int64), q.new_empty((), dtype=torch.int64)
            grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                t(dout),
                t(q),
                t(ke),
                t(ve),
                _bias(mask, q.dtype),
                t(out),
                _padded(lse_t.float(), _LSE_ALIGN),
                *rng,
                0.0,
                [True, True, True, False],
                causal,
                scale=scale,
            )[:3]
        dq, dk, dv = (t(g).to(acc) for g in grads)
    else:
        s, tanh = _scores(q, ke, causal, scale, mask, softcap)
        p = torch.exp(s - lse.transpose(1, 2).unsqueeze(-1))
        do = dout.to(acc)
        dv = torch.einsum("bnqk,bqnd->bknd", p, do)
        dp = torch.einsum("bqnd,bknd->bnqk", do, ve.to(acc))
        delta = (do * out.to(acc)).sum(-1).transpose(1, 2)  # [B, N, Sq]
        ds = p * (dp - delta.unsqueeze(-1))
        if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
            ds = ds * (1 - tanh * tanh)
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
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1)).add_(
        out_b.to(out_acc.dtype) * torch.exp(lse_b - safe).unsqueeze(-1)
    )
    lse_acc.copy_(new)
