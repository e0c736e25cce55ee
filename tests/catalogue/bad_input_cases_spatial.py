"""Catalogue cases of spatial parallelism: halo exchange, conv, transposed conv, pool, norm, resample.

Frames ``[B, C, L]`` (or ``[B, C, H, W]``) sharded along the last dim; the reference is the
unsharded torch op on the full frame, sliced to this rank's output block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bad_input_cases_comm import block, coords, per_rank
from bad_input_rank import Registry, rank, world

from shardkit import (
    balanced_split_sizes,
    halo_exchange,
    spatial_avg_pool,
    spatial_conv1d,
    spatial_conv2d,
    spatial_conv_transpose1d,
    spatial_group_norm,
    spatial_interpolate,
    spatial_max_pool,
    spatial_output_sizes,
)
from shardkit._shapes import split_offsets
from shardkit.spatial import spatial_transpose_output_sizes

CASES = Registry(
    __name__, frozenset({"avg_pool_kernel_differs_r2", "avg_pool_sizes_wrong_local_r2", "halo_right_width_differs_r3"})
)


def frame(L, C=2, dtype=torch.float64, seed=3):
    return torch.randn(1, C, L, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def weight(k, c_in=2, c_out=3, transposed=False):
    shape = (c_in, c_out, k) if transposed else (c_out, c_in, k)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


# ------------------------------------------------------------------ halo_exchange


def _halo(sizes, left, right, pass_sizes=True, periodic=False):
    full = coords(2, sum(sizes))
    off = split_offsets(sizes)[rank()]
    q = torch.arange(off - left, off + sizes[rank()] + right)
    L = sum(sizes)
    if periodic:
        want = full[:, q % L]
    else:
        inside = (q >= 0) & (q < L)
        want = torch.where(inside, full[:, q.clamp(0, L - 1)], torch.zeros(()))
    got = halo_exchange(
        block(full, 1, sizes), world(), 1, left, right, sizes=sizes if pass_sizes else None, periodic=periodic
    )
    return got, want


for _n in (1, 2, 3, 4):
    CASES.add(
        f"halo_control_r{_n}", _n, "halo_exchange", "control", lambda n=_n: _halo(balanced_split_sizes(12, n), 1, 2)
    )
CASES.add("halo_control_periodic_r3", 3, "halo_exchange", "control", lambda: _halo([4, 4, 4], 2, 1, periodic=True))
CASES.add("halo_control_wide_with_sizes_r3", 3, "halo_exchange", "control", lambda: _halo([13, 12, 12], 6, 14))
for _n, _sizes in ((2, [5, 3]), (3, [13, 12, 12]), (3, [37, 0, 0]), (4, [1, 0, 30, 6])):
    CASES.add(
        f"halo_uneven_no_sizes_wide_{'_'.join(map(str, _sizes))}",
        _n,
        "halo_exchange",
        "uneven",
        lambda s=_sizes: _halo(s, 6, 14, pass_sizes=False),
    )


def _halo_bad(x=None, left=1, right=1, dim=1, sizes=None, periodic=False):
    x = coords(2, 4) if x is None else x
    return halo_exchange(x, world(), dim, left, right, sizes=sizes, periodic=periodic), None


_HALO_BAD = {
    "widths_differ_r2": (2, lambda: _halo_bad(left=per_rank([1, 2]))),
    "right_width_differs_r3": (3, lambda: _halo_bad(right=per_rank([1, 1, 3]))),
    "negative_width_r2": (2, lambda: _halo_bad(left=-1)),
    "negative_width_one_rank_r2": (2, lambda: _halo_bad(left=per_rank([1, -1]))),
    "periodic_differs_r2": (2, lambda: _halo_bad(periodic=per_rank([True, False]))),
    "sizes_wrong_length_r3": (3, lambda: _halo_bad(sizes=[4, 4])),
    "sizes_wrong_local_r2": (2, lambda: _halo_bad(x=coords(2, per_rank([4, 5])), sizes=[4, 4])),
    "sizes_negative_r2": (2, lambda: _halo_bad(sizes=[12, -4])),
    "sizes_differ_r2": (2, lambda: _halo_bad(x=coords(2, per_rank([5, 3])), sizes=per_rank([[5, 3], [3, 3]]))),
    "other_dim_differs_r2": (2, lambda: _halo_bad(x=coords(per_rank([2, 3]), 4))),
    "dtype_differs_r2": (2, lambda: _halo_bad(x=coords(2, 4, dtype=per_rank([torch.float64, torch.float32])))),
    "dim_differs_r2": (2, lambda: _halo_bad(x=coords(4, 4), dim=per_rank([0, 1]))),
    "dim_out_of_range_r2": (2, lambda: _halo_bad(dim=2)),
    "width_list_wrong_length_r2": (2, lambda: _halo_bad(left=[1, 1, 1])),
}
for _name, (_n, _body) in _HALO_BAD.items():
    CASES.add(f"halo_{_name}", _n, "halo_exchange", "arg", _body)

# ------------------------------------------------------------------ conv


def _conv(sizes, k=3, stride=1, padding=1, pass_sizes=True, mode="zeros"):
    full, w = frame(sum(sizes)), weight(k)
    padded = full if mode == "zeros" else F.pad(full, (padding, padding), mode=mode)
    ref = F.conv1d(padded, w, stride=stride, padding=padding if mode == "zeros" else 0)
    out_sizes = spatial_output_sizes(sizes, k, stride, padding)
    got = spatial_conv1d(
        block(full, 2, sizes),
        w,
        None,
        world(),
        2,
        stride=stride,
        padding=padding,
        padding_mode=mode,
        sizes=sizes if pass_sizes else None,
    )
    return got, block(ref, 2, out_sizes)


for _n in (1, 2, 3, 4):
    CASES.add(f"conv1d_control_r{_n}", _n, "spatial_conv1d", "control", lambda n=_n: _conv(balanced_split_sizes(12, n)))
CASES.add("conv1d_control_stride2_r2", 2, "spatial_conv1d", "control", lambda: _conv([6, 6], k=3, stride=2))
CASES.add("conv1d_control_circular_r3", 3, "spatial_conv1d", "control", lambda: _conv([4, 4, 4], mode="circular"))
CASES.add("conv1d_control_circular_wider_than_frame_r2", 2, "spatial_conv1d", "control", lambda: _conv_wrap())


def _conv_wrap():
    """Circular padding 3 around a frame of 2: the halo wraps around more than once."""
    full, w = frame(2), weight(7)
    ref = F.conv1d(full[:, :, torch.arange(-3, 5) % 2], w)
    return spatial_conv1d(block(full, 2, [1, 1]), w, None, world(), 2, padding=3, padding_mode="circular"), block(
        ref, 2, [1, 1]
    )


CASES.add("conv1d_control_reflect_r2", 2, "spatial_conv1d", "control", lambda: _conv([5, 5], mode="reflect"))
for _n, _sizes in ((2, [7, 5]), (3, [13, 12, 12]), (3, [0, 20, 17]), (4, [1, 0, 30, 6])):
    CASES.add(
        f"conv1d_uneven_no_sizes_wide_{'_'.join(map(str, _sizes))}",
        _n,
        "spatial_conv1d",
        "uneven",
        lambda s=_sizes: _conv(s, k=9, padding=4, pass_sizes=False),
    )


def _conv2d_uneven():
    sizes = [13, 0, 7]
    full = torch.randn(1, 2, 5, 20, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w = torch.randn(3, 2, 3, 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref = F.conv2d(full, w, padding=(1, 3))
    got = spatial_conv2d(block(full, 3, sizes), w, None, world(), 3, padding=(1, 3))
    return got, block(ref, 3, spatial_output_sizes(sizes, 7, 1, 3))


CASES.add("conv2d_uneven_no_sizes_wide_r3", 3, "spatial_conv2d", "uneven", _conv2d_uneven)


def _conv_bad(x=None, k=3, stride=1, padding=1, mode="zeros", c_in=2, dim=2, sizes=None, bias=None):
    x = frame(4) if x is None else x
    return spatial_conv1d(
        x, weight(k, c_in=c_in), bias, world(), dim, stride=stride, padding=padding, padding_mode=mode, sizes=sizes
    ), None


_CONV_BAD = {
    "kernel_differs_r2": (2, lambda: _conv_bad(k=per_rank([3, 5]))),
    "stride_differs_r2": (2, lambda: _conv_bad(stride=per_rank([1, 2]))),
    "padding_differs_r2": (2, lambda: _conv_bad(padding=per_rank([1, 2]))),
    "padding_mode_differs_r2": (2, lambda: _conv_bad(mode=per_rank(["zeros", "circular"]))),
    "padding_mode_unknown_r2": (2, lambda: _conv_bad(mode="mirror")),
    "padding_negative_r2": (2, lambda: _conv_bad(padding=-1)),
    "weight_channels_wrong_r2": (2, lambda: _conv_bad(c_in=3)),
    "weight_channels_wrong_one_rank_r2": (2, lambda: _conv_bad(c_in=per_rank([2, 3]))),
    "channels_differ_across_ranks_r2": (2, lambda: _conv_bad(x=frame(4, C=per_rank([2, 3])), c_in=per_rank([2, 3]))),
    "dim_not_spatial_r2": (2, lambda: _conv_bad(dim=1)),
    "dim_differs_r2": (2, lambda: _conv_bad(dim=per_rank([2, -1]), x=frame(4))),
    "dtype_differs_r2": (2, lambda: _conv_bad(x=frame(4, dtype=per_rank([torch.float64, torch.float32])))),
    "sizes_wrong_local_r2": (2, lambda: _conv_bad(x=frame(per_rank([4, 5])), sizes=[4, 4])),
    "sizes_wrong_length_r3": (3, lambda: _conv_bad(sizes=[4, 4])),
    "bias_wrong_shape_one_rank_r2": (2, lambda: _conv_bad(bias=torch.zeros(per_rank([3, 4]), dtype=torch.float64))),
    "kernel_wider_than_frame_r2": (2, lambda: _conv_bad(x=frame(1), k=9, padding=0)),
}
for _name, (_n, _body) in _CONV_BAD.items():
    CASES.add(f"conv1d_{_name}", _n, "spatial_conv1d", "arg", _body)

# ------------------------------------------------------------------ transposed conv


def _tconv(sizes, k=3, stride=2, padding=1, pass_sizes=True):
    full, w = frame(sum(sizes)), weight(k, transposed=True)
    ref = F.conv_transpose1d(full, w, stride=stride, padding=padding)
    out_sizes = spatial_transpose_output_sizes(sizes, k, stride, padding)
    got = spatial_conv_transpose1d(
        block(full, 2, sizes), w, None, world(), 2, stride=stride, padding=padding, sizes=sizes if pass_sizes else None
    )
    return got, block(ref, 2, out_sizes)


for _n in (1, 2, 3):
    CASES.add(
        f"conv_transpose1d_control_r{_n}",
        _n,
        "spatial_conv_transpose1d",
        "control",
        lambda n=_n: _tconv(balanced_split_sizes(9, n)),
    )
CASES.add(
    "conv_transpose1d_uneven_no_sizes_r3",
    3,
    "spatial_conv_transpose1d",
    "uneven",
    lambda: _tconv([7, 0, 4], pass_sizes=False),
)


def _tconv_bad(k=3, stride=2, padding=1, x=None, sizes=None):
    x = frame(4) if x is None else x
    return spatial_conv_transpose1d(
        x, weight(k, transposed=True), None, world(), 2, stride=stride, padding=padding, sizes=sizes
    ), None


CASES.add(
    "conv_transpose1d_stride_differs_r2",
    2,
    "spatial_conv_transpose1d",
    "arg",
    lambda: _tconv_bad(stride=per_rank([2, 1])),
)
CASES.add(
    "conv_transpose1d_kernel_differs_r2", 2, "spatial_conv_transpose1d", "arg", lambda: _tconv_bad(k=per_rank([3, 5]))
)
CASES.add(
    "conv_transpose1d_padding_differs_r2",
    2,
    "spatial_conv_transpose1d",
    "arg",
    lambda: _tconv_bad(padding=per_rank([1, 0])),
)
CASES.add(
    "conv_transpose1d_sizes_wrong_local_r2",
    2,
    "spatial_conv_transpose1d",
    "sizes",
    lambda: _tconv_bad(x=frame(per_rank([4, 3])), sizes=[4, 4]),
)

# ------------------------------------------------------------------ pooling


def _pool(kind, sizes, k=2, stride=2, padding=0, pass_sizes=True):
    full = frame(sum(sizes))
    fn, ref_fn = {"max": (spatial_max_pool, F.max_pool1d), "avg": (spatial_avg_pool, F.avg_pool1d)}[kind]
    ref = ref_fn(full, k, stride, padding)
    got = fn(block(full, 2, sizes), world(), 2, k, stride, padding, sizes=sizes if pass_sizes else None)
    return got, block(ref, 2, spatial_output_sizes(sizes, k, stride, padding))


for _kind in ("max", "avg"):
    _op = f"spatial_{_kind}_pool"
    CASES.add(f"{_kind}_pool_control_r2", 2, _op, "control", lambda kind=_kind: _pool(kind, [6, 6]))
    CASES.add(
        f"{_kind}_pool_control_overlap_r3",
        3,
        _op,
        "control",
        lambda kind=_kind: _pool(kind, [4, 4, 4], k=3, stride=1, padding=1),
    )
    CASES.add(
        f"{_kind}_pool_uneven_no_sizes_r3",
        3,
        _op,
        "uneven",
        lambda kind=_kind: _pool(kind, [7, 0, 5], k=3, stride=1, padding=1, pass_sizes=False),
    )
    CASES.add(f"{_kind}_pool_kernel_differs_r2", 2, _op, "arg", lambda kind=_kind: _pool_bad(kind, k=per_rank([2, 3])))
    CASES.add(
        f"{_kind}_pool_stride_differs_r2", 2, _op, "arg", lambda kind=_kind: _pool_bad(kind, stride=per_rank([2, 1]))
    )
    CASES.add(
        f"{_kind}_pool_padding_differs_r2",
        2,
        _op,
        "arg",
        lambda kind=_kind: _pool_bad(kind, k=3, stride=1, padding=per_rank([1, 0])),
    )
    CASES.add(
        f"{_kind}_pool_sizes_wrong_local_r2",
        2,
        _op,
        "sizes",
        lambda kind=_kind: _pool_bad(kind, x=frame(per_rank([4, 6])), sizes=[4, 4]),
    )


def _pool_bad(kind, k=2, stride=2, padding=0, x=None, sizes=None):
    fn = {"max": spatial_max_pool, "avg": spatial_avg_pool}[kind]
    x = frame(4) if x is None else x
    return fn(x, world(), 2, k, stride, padding, sizes=sizes), None


# ------------------------------------------------------------------ group norm, resample


def _norm(sizes, groups=2, C=4):
    full = frame(sum(sizes), C=C)
    w = torch.linspace(0.5, 1.5, C, dtype=torch.float64)
    ref = F.group_norm(full, groups, w, None)
    return spatial_group_norm(block(full, 2, sizes), groups, w, None, world()), block(ref, 2, sizes)


CASES.add("group_norm_control_r2", 2, "spatial_group_norm", "control", lambda: _norm([5, 5]))
CASES.add("group_norm_uneven_r3", 3, "spatial_group_norm", "uneven", lambda: _norm([7, 0, 4]))
CASES.add(
    "group_norm_num_groups_differs_r2",
    2,
    "spatial_group_norm",
    "arg",
    lambda: (spatial_group_norm(frame(4, C=4), per_rank([2, 4]), None, None, world()), None),
)
CASES.add(
    "group_norm_channels_differ_r2",
    2,
    "spatial_group_norm",
    "shape",
    lambda: (spatial_group_norm(frame(4, C=per_rank([4, 6])), 2, None, None, world()), None),
)
CASES.add(
    "group_norm_channels_not_divisible_one_rank_r2",
    2,
    "spatial_group_norm",
    "local",
    lambda: (spatial_group_norm(frame(4, C=4), per_rank([2, 3]), None, None, world()), None),
)
CASES.add(
    "group_norm_dtype_differs_r2",
    2,
    "spatial_group_norm",
    "dtype",
    lambda: (
        spatial_group_norm(frame(4, C=4, dtype=per_rank([torch.float64, torch.float32])), 2, None, None, world()),
        None,
    ),
)
CASES.add(
    "group_norm_eps_differs_r2",
    2,
    "spatial_group_norm",
    "arg",
    lambda: (spatial_group_norm(frame(4, C=4), 2, None, None, world(), eps=per_rank([1e-5, 1e-3])), None),
)


def _resample(sizes, scale=2, pass_sizes=True, mode="nearest"):
    full = frame(sum(sizes))
    ref = F.interpolate(full, scale_factor=scale, mode=mode)
    got = spatial_interpolate(block(full, 2, sizes), world(), 2, scale, mode, sizes=sizes if pass_sizes else None)
    return got, block(ref, 2, [scale * s for s in sizes])


CASES.add("interpolate_control_r2", 2, "spatial_interpolate", "control", lambda: _resample([4, 4]))
CASES.add(
    "interpolate_linear_uneven_no_sizes_r3",
    3,
    "spatial_interpolate",
    "uneven",
    lambda: _resample([5, 0, 3], mode="linear", pass_sizes=False),
)
CASES.add(
    "interpolate_scale_differs_r2",
    2,
    "spatial_interpolate",
    "arg",
    lambda: (spatial_interpolate(frame(4), world(), 2, per_rank([2, 3]), "linear"), None),
)
CASES.add(
    "interpolate_mode_differs_r2",
    2,
    "spatial_interpolate",
    "arg",
    lambda: (spatial_interpolate(frame(4), world(), 2, 2, per_rank(["nearest", "linear"])), None),
)
CASES.add(
    "interpolate_sizes_wrong_local_r2",
    2,
    "spatial_interpolate",
    "sizes",
    lambda: (spatial_interpolate(frame(per_rank([4, 5])), world(), 2, 2, "linear", sizes=[4, 4]), None),
)
