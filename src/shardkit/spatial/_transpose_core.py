"""The geometry of a transposed convolution sharded along spatial dims: output lengths, which
outputs each rank owns (the adjoint of the window-centre rule), which inputs it reads, and the
argument checks. Shared by the one-dim (:mod:`.conv_transpose`) and tiled
(:mod:`.conv_transpose_tiled`) paths, which import it; it imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .._shapes import split_offsets
from ..errors import ShardkitError, ShardkitTypeError

_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def transpose_out_len(n: int, k: int, s: int, p: int, d: int, q: int) -> int:
    """Torch's output length of a transposed convolution over ``n`` inputs (may be <= 0)."""
    return (n - 1) * s - 2 * p + d * (k - 1) + q + 1


def transpose_bounds(sizes: Sequence[int], k: int, s: int, p: int, d: int, q: int) -> list[int]:
    """``R + 1`` output boundaries: rank ``r`` computes outputs ``[bounds[r], bounds[r+1])``."""
    n_out = transpose_out_len(sum(sizes), k, s, p, d, q)
    base = p - (d * (k - 1)) // 2  # output o belongs to the owner of input floor((o + base) / s)
    offsets = split_offsets(sizes)
    # outputs with floor((o + base) / s) < t are those with o < t*s - base
    return [0] + [min(max(offsets[r] * s - base, 0), n_out) for r in range(1, len(sizes))] + [n_out]


def transpose_input_ranges(sizes: Sequence[int], k: int, s: int, p: int, d: int, q: int) -> list[tuple[int, int]]:
    """Global input range ``[a_r, b_r)`` each rank reads, chosen so that the local transposed
    convolution (no padding) covers its outputs: ``a_r*s - p <= lo`` and
    ``(b_r - 1)*s - p + d*(k-1) >= hi - 1``. Inputs outside ``[0, N)`` are zeros; the extra
    inputs this alignment may add reach only outputs that are cropped."""
    bounds = transpose_bounds(sizes, k, s, p, d, q)
    ranges = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            ranges.append((0, 0))
            continue
        a = min(-((d * (k - 1) - lo - p) // s), (lo + p) // s)  # min(ceil((lo+p-d(k-1))/s), floor((lo+p)/s))
        last = max((hi - 1 + p) // s, -((d * (k - 1) + 1 - hi - p) // s))  # ceil((hi+p-d(k-1)-1)/s)
        ranges.append((a, last + 1))
    return ranges


def _check_geometry(n, k, s, p, d, q, op, R) -> None:
    if q >= s and q >= d:
        raise ShardkitError(
            f"{op}: output_padding {q} must be smaller than the stride {s} or the dilation {d} (as torch)"
        )
    if transpose_out_len(n, k, s, p, d, q) < 1:
        raise ShardkitError(
            f"{op}: non-positive output length for input size {n} (k={k}, s={s}, p={p}, d={d}, "
            f"output_padding={q}) in a group of {R}"
        )


def _check_weight(x, weight, bias, groups, nd, op):
    if not isinstance(weight, torch.Tensor) or (bias is not None and not isinstance(bias, torch.Tensor)):
        raise ShardkitTypeError(f"{op}: weight and bias must be tensors (bias may be None)")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ShardkitError(f"{op}: groups must be an int >= 1, got {groups!r}")
    if weight.dim() != nd + 2 or x.shape[1] != weight.shape[0] or weight.shape[0] % groups:
        raise ShardkitError(
            f"{op}: weight must be [C_in, C_out / groups, *K] with C_in = {x.shape[1]} divisible by "
            f"groups={groups}, got shape {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[1] * groups,):
        raise ShardkitError(f"{op}: bias must have shape ({weight.shape[1] * groups},), got {tuple(bias.shape)}")
