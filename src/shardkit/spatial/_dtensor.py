"""DTensor in, DTensor out for the sharded (transposed) convolutions of :func:`apply_spatial`.

An input ``DTensor`` (global shape ``[B, C, *S]``, or ``[B, *S, C]`` with ``channels_last``)
must be ``Shard(dim)`` on the mesh dim that is the layer's group, for each sharded dim (tiles:
``Shard(H)`` on the ``h`` group's mesh dim and ``Shard(W)`` on the ``w`` group's), and
``Replicate()`` or ``Shard(0)`` (the batch) on any other mesh dim. Its split is DTensor's
``torch.chunk`` split, so every rank knows every rank's input size from the metadata: the layer
gets them as ``sizes=`` (no size all-gather) and the local tensor without a copy.

The output is a DTensor with the input's placements. The layer's own output split is the
window-centre split of :func:`spatial_output_sizes` (:func:`spatial_transpose_output_sizes`),
which a DTensor can hold only where it is again the ``torch.chunk`` split of the output length:
always for stride-1 convolutions that keep the length; when it is not (some strided cases over
3+ ranks, e.g. ``H = 7`` over 3 ranks, ``k = 3, s = 2, p = 1``: ``[2, 1, 1]`` vs ``[2, 2, 0]``)
the layer raises :class:`ShardkitError` on every rank before computing.

Norms, pooling and upsampling take local tensors only (not DTensors) for now.

Source: PyTorch DTensor's ``Shard`` placement; the split rules of :mod:`shardkit.spatial._sizes`.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from .._shapes import chunk_sizes, normalize_dim
from ..comm._dtensor import check_placements, from_local, group_mesh_dim, local_of, shard_sizes
from ..errors import ShardkitError
from ._sizes import spatial_output_sizes
from .conv_transpose import spatial_transpose_output_sizes

__all__ = ["conv_dtensor"]


def _out_sizes(layer: Any, in_sizes: list[int], s: int) -> list[int]:
    """Every rank's output size along spatial dim ``s`` (0-based among the spatial dims)."""
    k, st, dl = layer.kernel_size[s], layer.stride[s], layer.dilation[s]
    if isinstance(layer, nn.modules.conv._ConvTransposeNd):
        return spatial_transpose_output_sizes(in_sizes, k, st, int(layer.padding[s]), layer.output_padding[s], dl)
    pad = layer.padding if isinstance(layer.padding, str) else layer.padding[s]
    return spatial_output_sizes(in_sizes, k, st, pad, dl)


def conv_dtensor(layer: Any, x: DTensor, sizes) -> DTensor:
    """Run the sharded convolution ``layer`` on DTensor ``x``; return the output as a DTensor.

    ``layer`` is a ``SpatialConv*d`` / ``SpatialConvTranspose*d`` (typed ``Any``: its ``dim`` and
    ``group`` are set by the mixin, not declared on ``nn.Module``).

    Raises:
        ShardkitError: ``sizes=`` given (the DTensor carries its split); no mesh dim of ``x``
            is the layer's group (or two sharded dims share one); a placement other than
            ``Shard(dim)`` there or ``Partial`` / a non-batch shard elsewhere; an output split
            that is not the ``torch.chunk`` split of the output (module docstring).
    """
    op = type(layer).__name__
    if sizes is not None:
        raise ShardkitError(f"{op}: a DTensor input carries its split; pass no sizes=")
    tiles = isinstance(layer.dim, tuple)
    dims = layer.dim if tiles else (layer.dim,)
    groups = layer.group if tiles else (layer.group,)
    mesh, nd = x.device_mesh, x.ndim
    wanted: dict[int, int] = {}
    for d, g in zip(dims, groups):
        i = group_mesh_dim(mesh, g, op)
        if i in wanted:
            raise ShardkitError(f"{op}: sharded dims {dims} share mesh dim {i}; each needs its own group")
        wanted[i] = normalize_dim(d, nd, op)
    check_placements(x, wanted, op)
    first = 1 if layer.channels_last else 2  # the first spatial dim
    in_sizes, shape = [], list(x.shape)
    out_len: dict[int, int] = {}
    for i, d in wanted.items():
        split = shard_sizes(x, i)
        out = _out_sizes(layer, split, d - first)
        want = chunk_sizes(sum(out), len(out))
        if out != want:
            raise ShardkitError(
                f"{op}: the input split {split} along dim {d} (a DTensor Shard) gives the output split {out}, "
                f"which is not the torch.chunk split {want} a DTensor Shard({d}) holds; pass local tensors"
            )
        in_sizes.append((d, split))
        out_len[d] = sum(out)
    by_dim = dict(in_sizes)
    split_arg = tuple(by_dim[normalize_dim(d, nd, op)] for d in dims)
    y = layer.forward(local_of(x), sizes=split_arg if tiles else split_arg[0])
    shape = [x.shape[0]] + [out_len.get(j, y.shape[j]) for j in range(1, nd)]
    return from_local(y, x, shape)
