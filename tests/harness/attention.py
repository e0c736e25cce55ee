"""The plain attention the context-parallel tests compare against (one process, full sequence)."""

import torch


def reference_attention(q, k, v, causal):
    """Softmax attention of ``[B, S, N, D]`` q and ``[B, S, N_kv, D]`` k/v (GQA by repetition)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", torch.softmax(scores, dim=-1), v)


def variant_attention(q, k, v, causal, *, window=None, softcap=None, cu=None, scale=None):
    """Eager attention with the variants, written out independently of shardkit's block plan.

    ``window``: flash-attn's ``(left, right)`` (``-1`` unbounded; causal forces ``j <= i``);
    ``softcap``: Gemma 2's ``cap * tanh(scores / cap)`` on the scaled scores before the mask;
    ``cu``: packed documents (attention within a document only). Returns ``(out [B, S, N, Dv],
    lse [B, S, N])``, differentiable (autograd through the eager ops).
    """
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s_len = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqnd,bknd->bnqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s_len)[:, None]
    j = torch.arange(s_len)[None, :]
    keep = torch.ones(s_len, s_len, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    if cu is not None:
        doc = torch.zeros(s_len, dtype=torch.int64)
        for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            doc[a:b] = d
        keep &= doc[:, None] == doc[None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, N, S]
    out = torch.einsum("bnqk,bknd->bqnd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(1, 2)


RTOL, ATOL = 1e-9, 1e-12


def problem(B, S, n, n_kv, D, seed=7):
    gen = torch.Generator().manual_seed(seed)  # identical on every rank: the full problem
    shapes = ((B, S, n, D), (B, S, n_kv, D), (B, S, n_kv, D), (B, S, n, D))
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]


def check_variant_parity(run, idx, shape, causal, window=None, softcap=None, cu=None, seed=7):
    """``run(q, k, v)`` on this rank's rows ``idx``; returns ``(out, lse)``. Compares out, lse and grads."""
    B, S, n, n_kv, D = shape
    q, k, v, w = problem(B, S, n, n_kv, D, seed)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = variant_attention(*ref, causal, window=window, softcap=softcap, cu=cu)
    (out_ref * w).sum().backward()
    loc = [t[:, idx].clone().requires_grad_() for t in (q, k, v)]
    out, lse = run(*loc)
    assert lse.dtype == torch.float64 and lse.shape == (B, len(idx), n) and not lse.requires_grad
    (out * w[:, idx]).sum().backward()
    pairs = [(out, out_ref), (lse, lse_ref)] + [(a.grad, b.grad) for a, b in zip(loc, ref)]
    for name, (got, want) in zip(("out", "lse", "dq", "dk", "dv"), pairs):
        torch.testing.assert_close(got, want[:, idx], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
