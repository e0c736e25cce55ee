"""Catalogue cases of context-parallel attention: Ulysses, ring (zigzag, contiguous, packed), USP.

q is ``[B, S, N, D]`` with GQA (N = 4 query heads, N_kv = 2) unless a case says otherwise; the
reference is full single-process attention (block-diagonal for packed documents) sliced to this
rank's tokens.
"""

from __future__ import annotations

import torch
from bad_input_cases_comm import per_rank
from bad_input_rank import Registry, follow, rank, world

from harness.helpers import get_mesh
from shardkit import balanced_split_sizes, ring_attention, ulysses_attention, usp_attention
from shardkit._shapes import split_offsets
from shardkit.context_parallel import (
    packed_all_gather,
    packed_gather,
    packed_indices,
    packed_split,
    usp_indices,
    zigzag_positions,
)

CASES = Registry(
    __name__,
    frozenset(
        {
            "ulysses_seq_len_negative_r2",
            "ulysses_head_dim_differs_across_ranks_r2",
            "ulysses_q_3d_r2",
            "ring_heads_differ_r2",
            "ring_batch_differs_r2",
            "ring_dtype_differs_across_ranks_r2",
        }
    ),
)


def problem(S, n=4, n_kv=2, D=4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(5)  # identical on every rank: the full problem
    return [
        torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
        for s in ((1, S, n, D), (1, S, n_kv, D), (1, S, n_kv, D))
    ]


def reference(q, k, v, causal=True, cu=None, scale=None):
    """Full softmax attention in float64 math; ``cu``: packed documents (block-diagonal mask)."""
    S, rep = q.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    cu = cu or [0, S]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= torch.ones(S, S, dtype=torch.bool).tril()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (torch.einsum("bqnd,bknd->bnqk", q, k) * scale).masked_fill(~keep, float("-inf"))
    return torch.einsum("bnqk,bknd->bqnd", torch.softmax(scores, dim=-1), v)


def contiguous(sizes):
    off = split_offsets(sizes)[rank()]
    return torch.arange(off, off + sizes[rank()])


def parity(fn, pos, S, cu=None, causal=True, **kw):
    """Run ``fn(q, k, v)`` on this rank's tokens ``pos``; the reference rows of those tokens."""
    q, k, v = problem(S, **kw)
    got = fn(*(t[:, pos] for t in (q, k, v)))
    return got, reference(q, k, v, causal, cu)[:, pos]


# ------------------------------------------------------------------ Ulysses


def _uly(n, S, sizes=None, seq_len=None, cu=None, causal=True, **kw):
    g = world()
    pos = contiguous(sizes or balanced_split_sizes(S, n))
    return parity(
        lambda q, k, v: ulysses_attention(q, k, v, g, causal=causal, seq_len=seq_len, cu_seqlens=cu),
        pos,
        S,
        cu,
        causal,
        **kw,
    )


for _n in (1, 2, 3, 4):
    CASES.add(f"ulysses_control_seq_len_r{_n}", _n, "ulysses_attention", "control", lambda n=_n: _uly(n, 8, seq_len=8))
CASES.add("ulysses_control_mha_r2", 2, "ulysses_attention", "control", lambda: _uly(2, 8, seq_len=8, n_kv=4))
CASES.add(
    "ulysses_control_not_causal_r3", 3, "ulysses_attention", "control", lambda: _uly(3, 9, seq_len=9, causal=False)
)
CASES.add("ulysses_control_packed_r2", 2, "ulysses_attention", "control", lambda: _uly(2, 12, cu=[0, 5, 12]))
CASES.add("ulysses_control_packed_r3", 3, "ulysses_attention", "control", lambda: _uly(3, 12, cu=[0, 3, 4, 12]))
for _n, _sizes in ((2, [5, 3]), (3, [13, 12, 12]), (3, [0, 30, 7]), (4, [0, 0, 1, 36])):
    CASES.add(
        f"ulysses_uneven_no_seq_len_{'_'.join(map(str, _sizes))}",
        _n,
        "ulysses_attention",
        "uneven",
        lambda n=_n, s=_sizes: _uly(n, sum(s), sizes=s),
    )


def _uly_bad(q, k=None, v=None, **kw):
    k = q if k is None else k
    v = k if v is None else v
    kw.setdefault("causal", True)
    return ulysses_attention(q, k, v, world(), **kw), None


def _q(s=4, n=4, d=4, b=1, dtype=torch.float64):
    return torch.zeros(b, s, n, d, dtype=dtype)


_BAD = {
    "seq_len_wrong_r2": (2, lambda: _uly_bad(_q(), seq_len=9)),
    "seq_len_differs_r2": (2, lambda: _uly_bad(_q(), seq_len=per_rank([8, 7]))),
    "seq_len_negative_r2": (2, lambda: _uly_bad(_q(), seq_len=-8)),
    "seq_len_uneven_given_r2": (2, lambda: _uly_bad(_q(s=per_rank([5, 3])), seq_len=8)),
    "scale_differs_r2": (2, lambda: _uly_bad(_q(), seq_len=8, scale=per_rank([0.5, 0.25]))),
    "causal_differs_r2": (2, lambda: _uly_bad(_q(), seq_len=8, causal=per_rank([True, False]))),
    "cu_seqlens_middle_differs_r2": (2, lambda: _uly_bad(_q(), cu_seqlens=per_rank([[0, 3, 8], [0, 5, 8]]))),
    "cu_seqlens_tail_wrong_r2": (2, lambda: _uly_bad(_q(), cu_seqlens=[0, 3, 9])),
    "cu_seqlens_not_increasing_r2": (2, lambda: _uly_bad(_q(), cu_seqlens=[0, 5, 3, 8])),
    "cu_seqlens_and_seq_len_disagree_r2": (2, lambda: _uly_bad(_q(), cu_seqlens=[0, 3, 8], seq_len=10)),
    "heads_differ_r2": (2, lambda: _uly_bad(_q(n=per_rank([4, 2])), seq_len=8)),
    "kv_heads_not_dividing_q_heads_r2": (2, lambda: _uly_bad(_q(n=4), _q(n=3), seq_len=8)),
    "head_dim_differs_one_rank_r2": (2, lambda: _uly_bad(_q(), _q(d=per_rank([4, 3])), seq_len=8)),
    "head_dim_differs_across_ranks_r2": (2, lambda: _uly_bad(_q(d=per_rank([4, 8])), seq_len=8)),
    "batch_differs_r2": (2, lambda: _uly_bad(_q(b=per_rank([1, 2])), seq_len=8)),
    "dtype_differs_across_ranks_r2": (
        2,
        lambda: _uly_bad(_q(dtype=per_rank([torch.float64, torch.float32])), seq_len=8),
    ),
    "qk_dtype_differs_one_rank_r2": (
        2,
        lambda: _uly_bad(_q(), _q(dtype=per_rank([torch.float64, torch.float32])), seq_len=8),
    ),
    "k_seq_differs_from_q_one_rank_r2": (2, lambda: _uly_bad(_q(), _q(s=per_rank([4, 5])), seq_len=8)),
    "q_3d_r2": (2, lambda: _uly_bad(torch.zeros(4, 4, 4), seq_len=8)),
    "q_not_tensor_one_rank_r2": (2, lambda: _uly_bad(per_rank([_q(), "q"]), _q(), seq_len=8)),
}
for _name, (_n, _body) in _BAD.items():
    CASES.add(f"ulysses_{_name}", _n, "ulysses_attention", "arg", _body)

# ------------------------------------------------------------------ ring


def _ring(n, S, layout="zigzag", seq_len=None, cu=None, pos=None, **kw):
    g = world()
    if pos is None:
        if cu is not None:
            pos = packed_indices(cu, n, rank())
        elif layout == "zigzag":
            pos = zigzag_positions(S, n, rank())
        else:
            pos = contiguous(balanced_split_sizes(S, n))
    return parity(
        lambda q, k, v: ring_attention(q, k, v, g, causal=True, layout=layout, seq_len=seq_len, cu_seqlens=cu),
        pos,
        S,
        cu,
        **kw,
    )


for _n in (1, 2, 3, 4):
    CASES.add(
        f"ring_control_zigzag_seq_len_r{_n}", _n, "ring_attention", "control", lambda n=_n: _ring(n, 16, seq_len=16)
    )
CASES.add("ring_control_contiguous_r3", 3, "ring_attention", "control", lambda: _ring(3, 12, "contiguous", seq_len=12))
CASES.add("ring_control_packed_r2", 2, "ring_attention", "control", lambda: _ring(2, 16, cu=[0, 4, 16]))
CASES.add("ring_control_packed_r3", 3, "ring_attention", "control", lambda: _ring(3, 24, cu=[0, 6, 8, 24]))
CASES.add("ring_control_mha_r2", 2, "ring_attention", "control", lambda: _ring(2, 8, seq_len=8, n_kv=4))
CASES.add("ring_uneven_zigzag_no_seq_len_r3", 3, "ring_attention", "uneven", lambda: _ring(3, 37))
CASES.add("ring_uneven_contiguous_no_seq_len_r4", 4, "ring_attention", "uneven", lambda: _ring(4, 37, "contiguous"))
CASES.add("ring_uneven_zigzag_no_seq_len_r2", 2, "ring_attention", "uneven", lambda: _ring(2, 7))


def _ring_bad(q, k=None, **kw):
    k = q if k is None else k
    kw.setdefault("causal", True)
    return ring_attention(q, k, k, world(), **kw), None


_RING_BAD = {
    "split_not_the_layout_r3": (3, lambda: _ring_bad(_q(s=[37, 0, 0][rank()]))),
    "seq_len_wrong_r2": (2, lambda: _ring_bad(_q(), seq_len=10)),
    "seq_len_differs_r2": (2, lambda: _ring_bad(_q(), seq_len=per_rank([8, 6]))),
    "layout_differs_r2": (2, lambda: _ring_bad(_q(), seq_len=8, layout=per_rank(["zigzag", "contiguous"]))),
    "layout_unknown_r2": (2, lambda: _ring_bad(_q(), seq_len=8, layout="spiral")),
    "scale_differs_r2": (2, lambda: _ring_bad(_q(), seq_len=8, scale=per_rank([0.5, 0.25]))),
    "causal_differs_r2": (2, lambda: _ring_bad(_q(), seq_len=8, causal=per_rank([True, False]))),
    "cu_seqlens_middle_differs_r2": (2, lambda: _ring_bad(_q(), cu_seqlens=per_rank([[0, 4, 6, 8], [0, 2, 6, 8]]))),
    "cu_seqlens_tail_wrong_r2": (2, lambda: _ring_bad(_q(), cu_seqlens=[0, 4, 10])),
    "cu_seqlens_negative_r2": (2, lambda: _ring_bad(_q(), cu_seqlens=[0, -4, 8])),
    "heads_differ_r2": (2, lambda: _ring_bad(_q(n=per_rank([4, 2])), seq_len=8)),
    "head_dim_differs_one_rank_r2": (2, lambda: _ring_bad(_q(), _q(d=per_rank([4, 3])), seq_len=8)),
    "kv_heads_not_dividing_r2": (2, lambda: _ring_bad(_q(n=4), _q(n=3), seq_len=8)),
    "dtype_differs_across_ranks_r2": (
        2,
        lambda: _ring_bad(_q(dtype=per_rank([torch.float64, torch.float32])), seq_len=8),
    ),
    "batch_differs_r2": (2, lambda: _ring_bad(_q(b=per_rank([1, 2])), seq_len=8)),
    "local_seq_differs_r2": (2, lambda: _ring_bad(_q(s=per_rank([4, 5])), seq_len=8)),
}
for _name, (_n, _body) in _RING_BAD.items():
    CASES.add(f"ring_{_name}", _n, "ring_attention", "arg", _body)


def _ulysses_vs_ring():
    q = _q()
    if rank() == 0:
        return ulysses_attention(q, q, q, world(), causal=True, seq_len=8), None
    return ring_attention(q, q, q, world(), causal=True, seq_len=8, layout="contiguous"), None


CASES.add("ulysses_vs_ring_mismatched_op_r2", 2, "ulysses_attention/ring_attention", "op", _ulysses_vs_ring)

# ------------------------------------------------------------------ USP (2 x 2 mesh)


def _mesh():
    world()
    return follow(get_mesh((2, 2), ("cp_ring", "cp_ulysses")))


def _usp(S, seq_len=None, cu=None, **kw):
    mesh = _mesh()
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    pos = usp_indices(cu or [0, S], 2, 2, i, j)
    return parity(
        lambda q, k, v: usp_attention(q, k, v, mesh, causal=True, seq_len=seq_len, cu_seqlens=cu), pos, S, cu, **kw
    )


CASES.add("usp_control_seq_len", 4, "usp_attention", "control", lambda: _usp(16, seq_len=16))
CASES.add("usp_control_packed", 4, "usp_attention", "control", lambda: _usp(24, cu=[0, 8, 24]))
CASES.add("usp_uneven_no_seq_len_37", 4, "usp_attention", "uneven", lambda: _usp(37))
CASES.add("usp_uneven_no_seq_len_3", 4, "usp_attention", "uneven", lambda: _usp(3))


def _usp_bad(n_local=None, **kw):
    mesh = _mesh()
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    n = len(usp_indices([0, 8], 2, 2, i, j)) if n_local is None else n_local
    q = _q(s=n, dtype=kw.pop("dtype", torch.float64))
    kw.setdefault("causal", True)
    return usp_attention(q, q, q, mesh, **kw), None


_USP_BAD = {
    "scale_differs_across_ring": lambda: _usp_bad(seq_len=8, scale=[0.5, 0.5, 0.25, 0.25][rank()]),
    "scale_differs_inside_ulysses": lambda: _usp_bad(seq_len=8, scale=[0.5, 0.25, 0.5, 0.5][rank()]),
    "seq_len_wrong": lambda: _usp_bad(seq_len=10),
    "seq_len_differs_one_rank": lambda: _usp_bad(seq_len=[8, 8, 8, 12][rank()]),
    "cu_seqlens_middle_differs": lambda: _usp_bad(cu_seqlens=[0, 2 if rank() == 3 else 4, 8]),
    "dtype_differs_one_rank": lambda: _usp_bad(seq_len=8, dtype=torch.float32 if rank() == 3 else torch.float64),
    "local_seq_wrong_one_rank": lambda: _usp_bad(n_local=[2, 2, 2, 3][rank()], seq_len=8),
    "causal_differs_one_rank": lambda: _usp_bad(seq_len=8, causal=rank() != 3),
}
for _name, _body in _USP_BAD.items():
    CASES.add(f"usp_{_name}", 4, "usp_attention", "arg", _body)

# ------------------------------------------------------------------ packed layouts (split / gather)
# Documents of 2 tokens. A moved interior boundary (one 3-token and one 1-token document instead of
# two of 2) keeps every rank's size for R = 2, so only the cu_seqlens values tell the ranks apart
# (issue 19, row 13: the agreement held only the last 9 entries). _CU_DEEP moves entry 9 of 21,
# past the entries the check row holds as they are: only its digest sees it.
_CU = list(range(0, 22, 2))
_CU_MOVED = [0, 3, *_CU[2:]]
_CU_DEEP = list(range(0, 42, 2))
_CU_DEEP_MOVED = [*_CU_DEEP[:9], 19, *_CU_DEEP[10:]]


def _packed(fn, n, cu, good):
    """``fn`` on this rank's packed-zigzag part (gathers) or the full tensor (split) of ``good``'s
    layout, passing ``cu``; the reference only when ``cu`` is ``good``."""
    full = torch.arange(2 * good[-1], dtype=torch.float64).view(1, good[-1], 2)
    mine = packed_indices(good, n, rank())
    if fn is packed_split:
        got, want = packed_split(full, cu, world(), 1)[0], full[:, mine]
    else:
        got, want = fn(full[:, mine], cu, world(), 1), full
    return got, want if cu == good else None


for _n in (1, 2, 3):
    CASES.add(
        f"packed_gather_control_r{_n}", _n, "packed_gather", "control", lambda n=_n: _packed(packed_gather, n, _CU, _CU)
    )
CASES.add("packed_split_control_r2", 2, "packed_split", "control", lambda: _packed(packed_split, 2, _CU_DEEP, _CU_DEEP))
CASES.add(
    "packed_all_gather_control_r3",
    3,
    "packed_all_gather",
    "control",
    lambda: _packed(packed_all_gather, 3, _CU_DEEP, _CU_DEEP),
)
for _fn in (packed_gather, packed_all_gather, packed_split):
    CASES.add(
        f"{_fn.__name__}_cu_seqlens_interior_differs_r2",
        2,
        _fn.__name__,
        "arg",
        lambda fn=_fn: _packed(fn, 2, per_rank([_CU, _CU_MOVED]), _CU),
    )
CASES.add(
    "packed_gather_cu_seqlens_deep_interior_differs_r2",
    2,
    "packed_gather",
    "arg",
    lambda: _packed(packed_gather, 2, per_rank([_CU_DEEP, _CU_DEEP_MOVED]), _CU_DEEP),
)
