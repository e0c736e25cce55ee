"""DTensor in, DTensor out for :func:`ring_attention`, :func:`ulysses_attention` and :func:`usp_attention`.

q, k, v given as ``DTensor`` s ``[B, S, N, D]`` (global shapes) must all be DTensors on one mesh
with one set of placements: ``Shard(1)`` (the sequence) on the mesh dim that is the op's group,
``Replicate()`` or ``Shard(0)`` (the batch) on any other mesh dim. Their local tensors go to the
plain path without a copy and the output (and the lse with ``return_lse``) comes back as a DTensor
with q's placements.

Layouts. A DTensor ``Shard(1)`` is the *contiguous* ``torch.chunk`` split of the sequence: rank
``r`` holds block ``r`` of ``chunk_sizes(S, R)``. So:

* ``ring_attention`` takes it only with ``layout="contiguous"`` (its causal work is then
  unbalanced: rank ``r`` computes ``r + 1`` blocks); zigzag and stripe expect another token
  order, which a DTensor cannot express: lay the sequence out with :func:`zigzag_split` and pass
  local tensors. The contiguous ring layout is the balanced split, so the chunk split must equal
  it (``S % R`` of 0, 1 or ``R - 1``; always for ``R = 2``), else :class:`ShardkitError`.
* ``ulysses_attention`` takes any contiguous split: when the chunk split is not the balanced one
  it learns the split (one metadata all-gather) instead of taking ``seq_len`` from the DTensor.
* ``usp_attention`` lays its ring parts out zigzag, so it takes DTensors only when the ring dim
  has one rank (then it is Ulysses over the other dim).

Source: PyTorch DTensor placements; the layouts of :mod:`shardkit.context_parallel.layouts`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.tensor import DTensor

from .._shapes import balanced_split_sizes
from ..comm._dtensor import any_dtensor, check_placements, from_local, group_mesh_dim, local_of, same_kind, shard_sizes
from ..errors import ShardkitError

__all__ = ["attention_dtensor", "takes_dtensors"]

F = TypeVar("F", bound=Callable[..., Any])


def _wrap(result, dq: DTensor, dv: DTensor):
    """The local output (or ``(out, lse)``) as DTensors with q's placements and global shapes."""
    B, S, N = dq.shape[0], dq.shape[1], dq.shape[2]
    if isinstance(result, tuple):
        out, lse = result
        return from_local(out, dq, (B, S, N, dv.shape[3])), from_local(lse, dq, (B, S, N))
    return from_local(result, dq, (B, S, N, dv.shape[3]))


def _seq_len(op: str, dq: DTensor, chunk: list[int], R: int, kwargs: dict, any_split: bool) -> int | None:
    """The ``seq_len=`` to pass: the DTensor's ``S`` when its split is the balanced one; None (learn
    the split) when ``any_split`` allows any contiguous split; else a ShardkitError."""
    S = dq.shape[1]
    given, cu = kwargs.get("seq_len"), kwargs.get("cu_seqlens")
    if given is not None and given != S:
        raise ShardkitError(f"{op}: seq_len={given} but the DTensor's global sequence length is {S}")
    if cu is not None and len(cu) and int(cu[-1]) != S:
        raise ShardkitError(f"{op}: cu_seqlens ends at {int(cu[-1])} but the DTensor's global sequence length is {S}")
    balanced = balanced_split_sizes(S, R)
    if chunk == balanced:
        return S
    if any_split and cu is None:
        return None
    raise ShardkitError(
        f"{op}: a DTensor Shard(1) splits S = {S} over {R} ranks as {chunk} (torch.chunk), but "
        f"{'packed documents need' if any_split else 'the contiguous ring layout is'} the balanced split {balanced}; "
        "pick S with S % R in (0, 1, R - 1), or pass local tensors in the balanced split"
    )


def attention_dtensor(
    fn: Callable[..., Any], op: str, q, k, v, group, kwargs: dict, usp_dims: tuple[str, str] | None = None
):
    """Run ``fn`` (the plain entry point ``op``) on the local tensors of DTensors ``q, k, v``.

    ``group`` is ring/Ulysses' group, or USP's 2-D mesh with ``usp_dims = (ring_dim, ulysses_dim)``;
    ``kwargs`` the keyword arguments of the call (``layout``, ``seq_len``, ``cu_seqlens``, ...).

    Returns:
        ``fn``'s output as a DTensor ``[B, S, N, Dv]`` (and the lse ``[B, S, N]`` with
        ``return_lse``), with q's mesh and placements.

    Raises:
        ShardkitTypeError: q, k, v mixing DTensors and plain tensors.
        ShardkitError: different meshes or placements among q, k, v; no mesh dim that is the
            group; a placement other than ``Shard(1)`` there (``Replicate``, ``Partial``, another
            dim); ``Partial`` or a non-batch shard elsewhere; a layout a DTensor cannot express
            (module docstring); ``seq_len`` / ``cu_seqlens`` disagreeing with the global ``S``.
    """
    dq, _, dv = same_kind({"q": q, "k": k, "v": v}, op)
    mesh = dq.device_mesh
    if usp_dims is None:
        seq_dim = group_mesh_dim(mesh, group, op)
        check_placements(dq, {seq_dim: 1}, op)
        layout = kwargs.get("layout")
        if layout is not None and layout != "contiguous":
            raise ShardkitError(
                f"{op}: a DTensor Shard(1) is the contiguous split of the sequence, but layout={layout!r} expects "
                "its own token order; pass layout='contiguous', or zigzag_split the sequence and pass local tensors"
            )
        any_split = layout is None  # Ulysses: any contiguous split
    else:
        ring_dim = group_mesh_dim(mesh, group[usp_dims[0]], op)
        seq_dim = group_mesh_dim(mesh, group[usp_dims[1]], op)
        check_placements(dq, {ring_dim: 1, seq_dim: 1}, op)
        if mesh.size(ring_dim) > 1:
            raise ShardkitError(
                f"{op}: the ring dim {usp_dims[0]!r} has {mesh.size(ring_dim)} ranks and USP lays the ring parts out "
                "zigzag, which a DTensor Shard(1) (contiguous) cannot express; use ring_attention(layout='contiguous') "
                "or ulysses_attention with DTensors, or usp_indices and local tensors"
            )
        any_split = True
    R = mesh.size(seq_dim)
    seq_len = _seq_len(op, dq, shard_sizes(dq, seq_dim), R, kwargs, any_split)
    locals_ = [local_of(t) for t in (q, k, v)]
    result = fn(*locals_, group, **{**kwargs, "seq_len": seq_len})
    return _wrap(result, dq, dv)


def takes_dtensors(group_arg: str = "group", usp: bool = False) -> Callable[[F], F]:
    """Decorator of an attention entry point ``fn(q, k, v, group_arg, ...)``: plain tensors go
    straight to ``fn``; DTensor ``q, k, v`` go through :func:`attention_dtensor`, which calls the
    undecorated ``fn`` on their local tensors with the call's other arguments (``usp``: the mesh's
    ``ring_dim`` / ``ulysses_dim`` arguments name its dims)."""

    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not any_dtensor(*args[:3], *(kwargs.get(n) for n in ("q", "k", "v"))):
                return fn(*args, **kwargs)  # the plain path: no binding on the hot path
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            named = dict(bound.arguments)
            q, k, v, group = (named.pop(n) for n in ("q", "k", "v", group_arg))
            dims = (named["ring_dim"], named["ulysses_dim"]) if usp else None
            return attention_dtensor(fn, fn.__name__, q, k, v, group, named, dims)

        return call  # type: ignore[return-value]

    return wrap
