"""The local checks every context-parallel attention runs first (Ulysses, ring, USP).

Each check reads this rank's own tensors and arguments; :func:`_validate` runs them under the
check mode's agreement (a failure on one rank becomes the same error on every rank).
"""

from __future__ import annotations

import torch

from ..comm._validate import enter, local_checks
from ..errors import ShardkitError, ShardkitTypeError
from ._options import Variant, variant
from ._sizes import check_cu_seqlens

__all__ = ["_validate", "_check_local"]

_OP = "ulysses_attention"


def _validate(q, k, v, group, causal, scale, cu_seqlens, seq_len, op=_OP, extra=None, options=None):
    """Resolve the group and run the local checks (shared with ring and USP attention).

    ``options``: the variant keywords (``window``, ``sliding_window``, ``softcap``,
    ``return_lse``) of :func:`._options.variant`.

    Returns ``(g, cu, seq_len, var, error)``: ``var`` the normalized :class:`Variant`; ``error``
    is a local check's ShardkitError in check mode (the caller hands it to the agreement, which
    raises it on every rank), else None (outside check mode it is raised here). ``extra``: more
    local checks of the caller, run after these.
    """
    g = enter(q, group, op)

    def checks():
        out = _check_local(q, k, v, g, causal, scale, cu_seqlens, seq_len, op)
        if extra is not None:
            extra(g)
        return (*out, variant(op, causal, **(options or {})))

    result, error = local_checks(g, checks)
    cu, seq_len, var = result if error is None else (None, None, Variant())
    return g, cu, seq_len, var, error


def _check_local(q, k, v, g, causal, scale, cu_seqlens, seq_len, op):
    """The checks of this rank's own tensors and arguments: ``(cu, seq_len)`` or a ShardkitError."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShardkitTypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if any(t.dim() != 4 for t in (q, k, v)):
        raise ShardkitError(
            f"{op}: q, k, v must be [B, S_local, N, D], got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ShardkitTypeError(f"{op}: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3]:
        raise ShardkitError(
            f"{op}: q [B, S_local, N, D], k [B, S_local, N_kv, D] and v [B, S_local, N_kv, Dv] disagree on B, S_local "
            f"or N_kv: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (group of {g.size})"
        )
    if q.shape[3] != k.shape[3]:
        raise ShardkitError(f"{op}: q and k head dims differ: D = {q.shape[3]} vs {k.shape[3]} (group of {g.size})")
    n, n_kv = q.shape[2], k.shape[2]
    if n_kv < 1 or n % n_kv:
        raise ShardkitError(
            f"{op}: the number of query heads ({n}) must be a multiple of the number of KV heads "
            f"({n_kv}) (group of {g.size})"
        )
    if not isinstance(causal, bool):
        raise ShardkitTypeError(f"{op}: causal must be a bool, got {causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ShardkitError(f"{op}: scale must be a positive number or None, got {scale!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0):
        raise ShardkitError(f"{op}: seq_len must be an int >= 0 or None, got {seq_len!r}")
    cu = None
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, op, total=seq_len)
        seq_len = cu[-1]
    return cu, seq_len  # seq_len None: neither given, the op learns the local lengths
