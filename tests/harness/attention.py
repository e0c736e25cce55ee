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
