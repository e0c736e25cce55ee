"""Pure size arithmetic of sharded convolutions (no process group, no tensors).

One spatial dim of global size ``N`` is split over ``R`` ranks (rank ``r`` holds the inputs
``[off_r, off_r + n_r)``). Along it a convolution has kernel ``k``, stride ``s``, dilation ``d``
and padding ``(p_l, p_r)``; output ``o`` reads the inputs ``o*s - p_l + d*[0, k)`` (negative or
``>= N`` positions are padding).

**Output rule (window centre).** Output ``o`` belongs to the rank whose input shard holds the
centre of its window, ``c(o) = o*s - p_l + (d*(k-1)) // 2``; centres before the first input go
to rank 0 and centres past the last input to rank ``R-1``. Why this rule:

* every rank computes exactly its own outputs, whatever the input split (uneven, zero-size);
* halos stay bounded by the kernel's reach (about ``d*(k-1)/2`` on each side), never by the
  split, so no rank ever needs a whole neighbour shard because of a size mismatch;
* a stride-1 ``"same"`` convolution maps every input split to the *same* output split, so
  residual additions and element-wise ops line up with the input shards;
* a stride-``s`` convolution of an even split of ``N = s * R * m`` gives an even split.

Source: the receptive-field decomposition of spatial (domain) parallelism for CNNs, e.g.
Dryden et al., "Improving strong-scaling of CNN training by exploiting finer-grained
parallelism" (IPDPS 2019), with shardkit's balanced uneven splits.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._shapes import check_split_sizes, split_offsets
from ..errors import ShardkitError, ShardkitTypeError

__all__ = [
    "conv_out_len",
    "conv_padding",
    "input_ranges",
    "output_bounds",
    "spatial_output_sizes",
    "geometry_args",
]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def per_dim(value, nd: int, name: str, op: str, minimum: int) -> tuple[int, ...]:
    """An int or a sequence of ``nd`` ints (each ``>= minimum``) as a tuple of ``nd`` ints."""
    values = (value,) * nd if _is_int(value) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(_is_int(v) for v in values):
        raise ShardkitTypeError(f"{op}: {name} must be an int or a sequence of {nd} ints, got {value!r}")
    if len(values) != nd or any(v < minimum for v in values):
        raise ShardkitError(f"{op}: {name} must be {nd} int(s) >= {minimum}, got {value!r}")
    return tuple(values)


def conv_padding(
    padding, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int], op: str
) -> list[tuple[int, int]]:
    """``(left, right)`` padding of each spatial dim, following ``torch.nn.functional.conv*d``.

    ``padding`` is an int, a sequence of one int per dim, ``"valid"`` (no padding) or ``"same"``
    (total ``d*(k-1)``, the smaller half on the left, as torch does for even kernels).

    Raises:
        ShardkitError: ``"same"`` with a stride other than 1 (torch rejects it too), an unknown
            string, or a negative padding.
    """
    nd = len(kernel)
    if isinstance(padding, str):
        mode = padding.lower()
        if mode == "valid":
            return [(0, 0)] * nd
        if mode != "same":
            raise ShardkitError(f"{op}: padding string must be 'same' or 'valid', got {padding!r}")
        if any(s != 1 for s in stride):
            raise ShardkitError(
                f"{op}: padding='same' needs stride 1 in every dim (as torch), got stride={tuple(stride)}"
            )
        totals = [d * (k - 1) for k, d in zip(kernel, dilation)]
        return [(t // 2, t - t // 2) for t in totals]
    return [(p, p) for p in per_dim(padding, nd, "padding", op, 0)]


def conv_out_len(n: int, k: int, s: int, d: int, pad: tuple[int, int]) -> int:
    """Output length of a convolution over ``n`` inputs (torch's formula); may be <= 0."""
    return (n + pad[0] + pad[1] - d * (k - 1) - 1) // s + 1


def output_bounds(sizes: Sequence[int], k: int, s: int, d: int, pad: tuple[int, int]) -> list[int]:
    """``R + 1`` output boundaries: rank ``r`` computes outputs ``[bounds[r], bounds[r+1])``.

    Implements the window-centre rule of the module docstring.
    """
    n_out = conv_out_len(sum(sizes), k, s, d, pad)
    base = -pad[0] + (d * (k - 1)) // 2  # centre of output o is o*s + base

    def below(t: int) -> int:  # number of outputs whose centre is < t
        return min(max(-((base - t) // s), 0), n_out)  # ceil((t - base) / s), clamped

    offsets = split_offsets(sizes)
    return [0] + [below(offsets[r]) for r in range(1, len(sizes))] + [n_out]


def input_ranges(sizes: Sequence[int], k: int, s: int, d: int, pad: tuple[int, int]) -> list[tuple[int, int]]:
    """Global input range ``[a_r, b_r)`` each rank's outputs read, padding included.

    Positions ``< 0`` or ``>= N`` are padding; an empty range is ``(0, 0)``.
    """
    bounds = output_bounds(sizes, k, s, d, pad)
    ranges = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            ranges.append((0, 0))
        else:
            ranges.append((lo * s - pad[0], (hi - 1) * s - pad[0] + d * (k - 1) + 1))
    return ranges


def spatial_output_sizes(
    in_sizes: Sequence[int],
    kernel_size: int,
    stride: int = 1,
    padding: int | tuple[int, int] | str = 0,
    dilation: int = 1,
) -> list[int]:
    """Per-rank output sizes of a convolution sharded along one spatial dim.

    A pure function of the input split and the convolution along that dim (window-centre rule,
    see :mod:`shardkit.spatial._sizes`), so every rank can compute every rank's sizes, e.g. to
    pass ``sizes=`` to the next sharded layer or to :func:`shardkit.all_gather`.

    Args:
        in_sizes: input size of each of the ``R`` ranks along the sharded dim, e.g.
            ``balanced_split_sizes(N, R)``; zero sizes allowed.
        kernel_size: kernel size ``k`` along that dim (>= 1).
        stride: stride ``s`` (>= 1).
        padding: an int (both sides), a ``(left, right)`` pair, ``"valid"`` or ``"same"``.
        dilation: dilation ``d`` (>= 1).

    Returns:
        ``R`` sizes summing to torch's output length, e.g.
        ``spatial_output_sizes([4, 3, 3], 3, padding=1) == [4, 3, 3]`` and
        ``spatial_output_sizes([4, 4, 4, 4], 3, stride=2, padding=1) == [2, 2, 2, 2]``.

    Raises:
        ShardkitError: bad sizes or arguments, or a kernel larger than the padded input.
        ShardkitTypeError: non-int arguments.
    """
    op = "spatial_output_sizes"
    if isinstance(in_sizes, (str, bytes)) or not isinstance(in_sizes, Sequence) or not in_sizes:
        raise ShardkitTypeError(f"{op}: in_sizes must be a non-empty sequence of ints, got {in_sizes!r}")
    sizes = check_split_sizes(in_sizes, len(in_sizes), None, op)
    (k,), (s,), (d,) = (
        per_dim(v, 1, name, op, 1)
        for v, name in ((kernel_size, "kernel_size"), (stride, "stride"), (dilation, "dilation"))
    )
    pad: tuple[int, int]
    if isinstance(padding, str):
        (pad,) = conv_padding(padding, (k,), (s,), (d,), op)
    elif isinstance(padding, int) and _is_int(padding):
        pad = (padding, padding)
    else:
        before, after = per_dim(padding, 2, "padding", op, 0)
        pad = (before, after)
    if pad[0] < 0 or pad[1] < 0:
        raise ShardkitError(f"{op}: padding must be >= 0, got {padding!r}")
    check_out_len(sum(sizes), k, s, d, pad, op, len(sizes))
    bounds = output_bounds(sizes, k, s, d, pad)
    return [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def check_out_len(n: int, k: int, s: int, d: int, pad: tuple[int, int], op: str, R: int) -> int:
    """Torch's output length, or a ShardkitError when the kernel does not fit (as torch)."""
    n_out = conv_out_len(n, k, s, d, pad)
    if n_out < 1:
        raise ShardkitError(
            f"{op}: the dilated kernel ({d * (k - 1) + 1}) is larger than the padded global input "
            f"({n} + {pad[0]} + {pad[1]}) in a group of {R}"
        )
    return n_out


def geometry_args(weight, bias, stride, padding, dilation, groups, mode) -> tuple:
    """What every rank must agree on about a convolution in check mode (it sets the halo widths
    and message sizes): weight shape (kernel, channels), bias shape (a wrong one on one rank is
    then everyone's error), stride, padding, dilation, groups, and the padding mode (or a
    transposed convolution's output padding)."""
    shape, bias_shape = getattr(weight, "shape", None), getattr(bias, "shape", None)
    return (
        tuple(shape) if shape is not None else None,
        bias is not None,
        tuple(bias_shape) if bias_shape is not None else None,
        stride,
        padding,
        dilation,
        groups,
        mode,
    )
