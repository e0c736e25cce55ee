"""Catalogue cases of the differentiable collectives (shardkit.comm): f/g, gather, scatter, all-to-all.

Data is coordinate-encoded (value = global index + offset) so that the single-process reference
of every rank's output is a slice of the full tensor.
"""

from __future__ import annotations

import torch
from bad_input_rank import Registry, follow, rank, world

from harness.helpers import get_mesh, subgroup
from shardkit import (
    all_gather,
    all_reduce_backward,
    all_reduce_forward,
    all_to_all,
    balanced_split_sizes,
    gather_forward_split_backward,
    reduce_scatter,
    split_forward_gather_backward,
)
from shardkit._shapes import split_offsets

# Variants that the sibling op (all_reduce_forward, all_gather, reduce_scatter) runs through the
# same validation code: left out of the second op to keep the catalogue under 90 s.
_SIBLING_VARIANTS = [
    "control_r1",
    "control_r3",
    "control_r4",
    "numel_mismatch_r3",
    "ndim_mismatch",
    "noncontiguous",
    "group_none",
    "control_sizes_r1",
    "control_sizes_r2",
    "control_sizes_r4",
    "uneven_no_sizes_5_3",
    "uneven_no_sizes_0_20_17",
    "uneven_with_sizes_r3",
    "noncontiguous_r3",
    "negative_dim_r2",
    "sizes_wrong_sum_r3",
    "sizes_negative_r3",
    "sizes_not_ints_r2",
    "dim_out_of_range_r2",
    "dim_out_of_range_one_rank_r2",
    "ndim_mismatch_r2",
    "sizes_with_uneven_local_mismatch_r2",
    "uneven_balanced_r4",
    "noncontiguous_r2",
    "sizes_wrong_length_r3",
    "sizes_negative_r2",
    "sizes_differ_across_ranks_r2",
    "dim_differs_r2",
    "dtype_mismatch_r2",
]
_SKIP = {
    f"{op}_{v}"
    for op in ("all_reduce_backward", "gather_forward_split_backward", "split_forward_gather_backward")
    for v in _SIBLING_VARIANTS
}
CASES = Registry(__name__, frozenset(_SKIP))


def coords(*shape, dtype=torch.float64, offset=1.0):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=dtype) + offset).view(*shape)


def block(full, dim, sizes, r=None):
    r = rank() if r is None else r
    return full.narrow(dim, split_offsets(sizes)[r], sizes[r]).clone()


def per_rank(values):
    return values[rank() % len(values)]


# ------------------------------------------------------------------ f / g (all-reduce regions)


def _f_g(op, n, shape=(2, 3), dtype=torch.float64):
    x = coords(*shape, dtype=dtype)
    want = x * n if op is all_reduce_forward else x
    return op(x, world()), want


for _name, _op in (("all_reduce_forward", all_reduce_forward), ("all_reduce_backward", all_reduce_backward)):
    for _n in (1, 2, 3, 4):
        CASES.add(f"{_name}_control_r{_n}", _n, _name, "control", lambda op=_op, n=_n: _f_g(op, n))
    CASES.add(
        f"{_name}_shape_mismatch", 2, _name, "shape", lambda op=_op: (op(coords(2, per_rank([3, 4])), world()), None)
    )
    CASES.add(
        f"{_name}_numel_mismatch_r3", 3, _name, "shape", lambda op=_op: (op(coords(per_rank([6, 6, 5])), world()), None)
    )
    CASES.add(
        f"{_name}_ndim_mismatch",
        2,
        _name,
        "shape",
        lambda op=_op: (op(coords(*per_rank([(6,), (2, 3)])), world()), None),
    )
    CASES.add(
        f"{_name}_dtype_mismatch",
        2,
        _name,
        "dtype",
        lambda op=_op: (op(coords(2, 3, dtype=per_rank([torch.float64, torch.float32])), world()), None),
    )
    CASES.add(f"{_name}_noncontiguous", 2, _name, "control", lambda op=_op: _f_g_noncontig(op))
    CASES.add(
        f"{_name}_not_a_tensor_one_rank",
        2,
        _name,
        "local",
        lambda op=_op: (op(per_rank([coords(2), [1.0, 2.0]]), world()), None),
    )
    CASES.add(f"{_name}_group_none", 2, _name, "group", lambda op=_op: (op(coords(2), None), None))
    CASES.add(f"{_name}_int_requires_grad_one_rank", 2, _name, "local", lambda op=_op: (op(_int_grad(), world()), None))


def _f_g_noncontig(op):
    x = coords(3, 2).t()
    return op(x, world()), (x * 2 if op is all_reduce_forward else x)


def _int_grad():
    x = torch.arange(4)
    if rank() == 1:
        x = x.float().requires_grad_()  # rank 1 float, rank 0 int64: dtype differs too
    return x


def _f_vs_g():
    x = coords(2, 3)
    op = per_rank([all_reduce_forward, all_reduce_backward])
    return op(x, world()), None


CASES.add("f_vs_g_mismatched_op", 2, "all_reduce_forward/backward", "op", _f_vs_g)


def _f_vs_g_backward():
    """f on rank 0, g on rank 1, then backward: the mismatch meets in the backward all-reduce."""
    x = coords(2, 3).requires_grad_()
    op = per_rank([all_reduce_forward, all_reduce_backward])
    op(x, world()).sum().backward()
    return x.grad, None


CASES.add("f_vs_g_mismatched_op_backward", 2, "all_reduce_forward/backward", "op", _f_vs_g_backward)


def _mesh_dim_sizes_wrong_group():
    """A 2x2 mesh: every rank passes sizes for the 4-rank world to the 2-rank ``tp`` group."""
    mesh = get_mesh((2, 2), ("dp", "tp"))
    world()
    tp = follow(mesh["tp"])
    x = coords(1, 2)
    return all_gather(x, tp, 1, sizes=[2, 2, 2, 2]), None


CASES.add("all_gather_sizes_for_another_group", 4, "all_gather", "group", _mesh_dim_sizes_wrong_group)


def _not_member():
    """Rank 2 passes the group (0, 1) it is not a member of; ranks 0 and 1 pass the world."""
    sub, w = subgroup((0, 1)), world()
    g = sub if rank() == 2 else w
    return all_reduce_forward(coords(2), g), None


CASES.add("all_reduce_forward_group_not_member", 3, "all_reduce_forward", "group", _not_member)


def _group_size_mismatch():
    """Ranks 0 and 1 call on the pair (0, 1); rank 2 calls on the world: different group sizes."""
    sub, w = subgroup((0, 1)), world()
    g = w if rank() == 2 else sub
    return all_gather(coords(1, 2), g, 1, sizes=[2] * (3 if rank() == 2 else 2)), None


CASES.add("all_gather_group_size_mismatch", 3, "all_gather", "group", _group_size_mismatch)

# ------------------------------------------------------------------ all_gather / gather_forward_split_backward

_GATHERS = {"all_gather": all_gather, "gather_forward_split_backward": gather_forward_split_backward}
_SPLITS = {2: [5, 3], 3: [13, 12, 12], 4: [1, 0, 30, 6]}


def _gather(op, n, sizes, pass_sizes, dim=1, noncontig=False, dtype=torch.float64):
    full = coords(2, sum(sizes), 3, dtype=dtype)
    local = block(full, 1, sizes)
    if noncontig:
        local = local.transpose(0, 2).contiguous().transpose(0, 2)
    return op(local, world(), dim, sizes=sizes if pass_sizes else None), full


def _gather_bad(op, local, dim=1, sizes=None):
    return op(local, world(), dim, sizes=sizes), None


for _name, _op in _GATHERS.items():
    for _n in (1, 2, 3, 4):
        CASES.add(
            f"{_name}_control_sizes_r{_n}",
            _n,
            _name,
            "control",
            lambda op=_op, n=_n: _gather(op, n, balanced_split_sizes(8, n), True),
        )
    for _n, _sizes in ((2, [5, 3]), (3, [13, 12, 12]), (3, [37, 0, 0]), (3, [0, 20, 17]), (4, [1, 0, 30, 6])):
        CASES.add(
            f"{_name}_uneven_no_sizes_{'_'.join(map(str, _sizes))}",
            _n,
            _name,
            "uneven",
            lambda op=_op, n=_n, s=_sizes: _gather(op, n, s, False),
        )
    CASES.add(f"{_name}_uneven_with_sizes_r3", 3, _name, "control", lambda op=_op: _gather(op, 3, [13, 12, 12], True))
    CASES.add(
        f"{_name}_noncontiguous_r3",
        3,
        _name,
        "control",
        lambda op=_op: _gather(op, 3, [13, 12, 12], False, noncontig=True),
    )
    CASES.add(
        f"{_name}_negative_dim_r2",
        2,
        _name,
        "control",
        lambda op=_op: (op(block(coords(2, 3, 8), 2, [4, 4]), world(), -1), coords(2, 3, 8)),
    )
    CASES.add(
        f"{_name}_sizes_wrong_sum_r3",
        3,
        _name,
        "sizes",
        lambda op=_op: _gather_bad(op, block(coords(2, 37, 3), 1, [13, 12, 12]), sizes=[12, 12, 12]),
    )
    CASES.add(
        f"{_name}_sizes_wrong_length_r3",
        3,
        _name,
        "sizes",
        lambda op=_op: _gather_bad(op, coords(2, 4, 3), sizes=[4, 4]),
    )
    CASES.add(
        f"{_name}_sizes_negative_r3",
        3,
        _name,
        "sizes",
        lambda op=_op: _gather_bad(op, coords(2, 4, 3), sizes=[4, -4, 4]),
    )
    CASES.add(
        f"{_name}_sizes_not_ints_r2",
        2,
        _name,
        "sizes",
        lambda op=_op: _gather_bad(op, coords(2, 4, 3), sizes=[4.0, 4.0]),
    )
    CASES.add(
        f"{_name}_sizes_differ_across_ranks_r2",
        2,
        _name,
        "sizes",
        lambda op=_op: _gather_bad(
            op, block(coords(2, 8, 3), 1, per_rank([[5, 3], [3, 5]])), sizes=per_rank([[5, 3], [3, 5]])
        ),
    )
    CASES.add(f"{_name}_dim_out_of_range_r2", 2, _name, "dim", lambda op=_op: _gather_bad(op, coords(2, 4, 3), dim=3))
    CASES.add(
        f"{_name}_dim_differs_across_ranks_r2",
        2,
        _name,
        "dim",
        lambda op=_op: _gather_bad(op, coords(2, 4, 3), dim=per_rank([0, 1])),
    )
    CASES.add(
        f"{_name}_dim_out_of_range_one_rank_r2",
        2,
        _name,
        "dim",
        lambda op=_op: _gather_bad(op, coords(2, 4, 3), dim=per_rank([1, 5])),
    )
    CASES.add(
        f"{_name}_other_dim_mismatch_r2",
        2,
        _name,
        "shape",
        lambda op=_op: _gather_bad(op, coords(2, 4, per_rank([3, 4]))),
    )
    CASES.add(
        f"{_name}_ndim_mismatch_r2",
        2,
        _name,
        "shape",
        lambda op=_op: _gather_bad(op, coords(*per_rank([(2, 4, 3), (2, 4, 3, 1)]))),
    )
    CASES.add(
        f"{_name}_dtype_mismatch_r3",
        3,
        _name,
        "dtype",
        lambda op=_op: _gather_bad(op, coords(2, 4, 3, dtype=per_rank([torch.float64, torch.float64, torch.float32]))),
    )
    CASES.add(
        f"{_name}_sizes_with_uneven_local_mismatch_r2",
        2,
        _name,
        "sizes",
        lambda op=_op: _gather_bad(op, coords(2, per_rank([5, 3]), 3), sizes=[4, 4]),
    )

for _scale in ("sideways", 2):
    CASES.add(
        f"gather_forward_split_backward_bad_grad_scale_{_scale}",
        2,
        "gather_forward_split_backward",
        "arg",
        lambda s=_scale: (gather_forward_split_backward(coords(2, 3), world(), 0, grad_scale=s), None),
    )
CASES.add(
    "gather_forward_split_backward_grad_scale_differs",
    2,
    "gather_forward_split_backward",
    "arg",
    lambda: (
        gather_forward_split_backward(coords(2, 3).requires_grad_(), world(), 0, grad_scale=per_rank(["up", None])),
        None,
    ),
)

# ------------------------------------------------------------------ reduce_scatter / split_forward_gather_backward


def _scatter(op, n, N=8, sizes=None, noncontig=False):
    full = coords(N, 3)
    x = full.t().contiguous().t() if noncontig else full
    want_full = full * n if op is reduce_scatter else full
    want = block(want_full, 0, sizes or balanced_split_sizes(N, n))
    return op(x, world(), 0, sizes=sizes), want


_SCATTERS = {"reduce_scatter": reduce_scatter, "split_forward_gather_backward": split_forward_gather_backward}
for _name, _op in _SCATTERS.items():
    for _n in (1, 2, 3, 4):
        CASES.add(f"{_name}_control_r{_n}", _n, _name, "control", lambda op=_op, n=_n: _scatter(op, n))
    CASES.add(f"{_name}_uneven_sizes_r3", 3, _name, "control", lambda op=_op: _scatter(op, 3, 37, [30, 0, 7]))
    CASES.add(f"{_name}_uneven_balanced_r4", 4, _name, "control", lambda op=_op: _scatter(op, 4, 37))
    CASES.add(f"{_name}_noncontiguous_r2", 2, _name, "control", lambda op=_op: _scatter(op, 2, noncontig=True))
    CASES.add(
        f"{_name}_sizes_wrong_sum_r2", 2, _name, "sizes", lambda op=_op: (op(coords(8, 3), world(), 0, [4, 5]), None)
    )
    CASES.add(
        f"{_name}_sizes_wrong_length_r3", 3, _name, "sizes", lambda op=_op: (op(coords(8, 3), world(), 0, [4, 4]), None)
    )
    CASES.add(
        f"{_name}_sizes_negative_r2", 2, _name, "sizes", lambda op=_op: (op(coords(8, 3), world(), 0, [10, -2]), None)
    )
    CASES.add(
        f"{_name}_sizes_differ_across_ranks_r2",
        2,
        _name,
        "sizes",
        lambda op=_op: (op(coords(8, 3), world(), 0, per_rank([[4, 4], [5, 3]])), None),
    )
    CASES.add(
        f"{_name}_full_dim_mismatch_r2",
        2,
        _name,
        "shape",
        lambda op=_op: (op(coords(per_rank([8, 9]), 3), world(), 0), None),
    )
    CASES.add(
        f"{_name}_dim_differs_r2", 2, _name, "dim", lambda op=_op: (op(coords(4, 4), world(), per_rank([0, 1])), None)
    )
    CASES.add(f"{_name}_dim_out_of_range_r2", 2, _name, "dim", lambda op=_op: (op(coords(4, 4), world(), -3), None))
    CASES.add(
        f"{_name}_dtype_mismatch_r2",
        2,
        _name,
        "dtype",
        lambda op=_op: (op(coords(4, 4, dtype=per_rank([torch.float64, torch.float32])), world(), 0), None),
    )

# ------------------------------------------------------------------ all_to_all


def _a2a(n, S, sizes=None, gather_size=None, noncontig=False):
    """[B, S/R, N, D] -> [B, S, N/R, D] with N = 5 heads (uneven over R too)."""
    sizes = sizes or balanced_split_sizes(S, n)
    full = coords(2, S, 5, 3)
    local = block(full, 1, sizes)
    if noncontig:
        local = local.transpose(0, 3).contiguous().transpose(0, 3)
    return all_to_all(local, world(), 2, 1, gather_size=gather_size), block(full, 2, balanced_split_sizes(5, n))


for _n in (1, 2, 3, 4):
    CASES.add(
        f"all_to_all_control_gather_size_r{_n}", _n, "all_to_all", "control", lambda n=_n: _a2a(n, 8, gather_size=8)
    )
for _n, _sizes in ((2, [5, 3]), (3, [13, 12, 12]), (3, [37, 0, 0]), (4, [1, 0, 30, 6])):
    CASES.add(
        f"all_to_all_uneven_no_gather_size_{'_'.join(map(str, _sizes))}",
        _n,
        "all_to_all",
        "uneven",
        lambda n=_n, s=_sizes: _a2a(n, sum(s), sizes=s),
    )
CASES.add("all_to_all_noncontiguous_r3", 3, "all_to_all", "control", lambda: _a2a(3, 37, noncontig=True))


def _a2a_bad(x, scatter_dim=2, gather_dim=1, gather_size=None):
    return all_to_all(x, world(), scatter_dim, gather_dim, gather_size=gather_size), None


CASES.add("all_to_all_same_dims_r2", 2, "all_to_all", "dim", lambda: _a2a_bad(coords(1, 4, 4, 2), 1, 1))
CASES.add("all_to_all_dim_out_of_range_r2", 2, "all_to_all", "dim", lambda: _a2a_bad(coords(1, 4, 4, 2), 4, 1))
CASES.add(
    "all_to_all_dims_differ_r2", 2, "all_to_all", "dim", lambda: _a2a_bad(coords(1, 4, 4, 2), per_rank([2, 3]), 1)
)
CASES.add(
    "all_to_all_gather_size_wrong_r3",
    3,
    "all_to_all",
    "sizes",
    lambda: _a2a_bad(block(coords(1, 37, 4, 2), 1, [13, 12, 12]), gather_size=36),
)
CASES.add(
    "all_to_all_gather_size_negative_r2", 2, "all_to_all", "sizes", lambda: _a2a_bad(coords(1, 4, 4, 2), gather_size=-8)
)
CASES.add(
    "all_to_all_gather_size_float_r2", 2, "all_to_all", "sizes", lambda: _a2a_bad(coords(1, 4, 4, 2), gather_size=8.0)
)
CASES.add(
    "all_to_all_gather_size_differs_r2",
    2,
    "all_to_all",
    "sizes",
    lambda: _a2a_bad(coords(1, 4, 4, 2), gather_size=per_rank([8, None])),
)
CASES.add(
    "all_to_all_gather_size_uneven_given_r2",
    2,
    "all_to_all",
    "sizes",
    lambda: _a2a_bad(coords(1, per_rank([5, 3]), 4, 2), gather_size=8),
)
CASES.add(
    "all_to_all_scatter_dim_size_differs_r2",
    2,
    "all_to_all",
    "shape",
    lambda: _a2a_bad(coords(1, 4, per_rank([4, 5]), 2)),
)
CASES.add(
    "all_to_all_other_dim_differs_r3", 3, "all_to_all", "shape", lambda: _a2a_bad(coords(1, 4, 4, per_rank([2, 2, 3])))
)
CASES.add(
    "all_to_all_dtype_mismatch_r2",
    2,
    "all_to_all",
    "dtype",
    lambda: _a2a_bad(coords(1, 4, 4, 2, dtype=per_rank([torch.float64, torch.float32]))),
)
CASES.add(
    "all_to_all_ndim_mismatch_r2",
    2,
    "all_to_all",
    "shape",
    lambda: _a2a_bad(coords(*per_rank([(1, 4, 4, 2), (1, 4, 4, 2, 1)]))),
)
