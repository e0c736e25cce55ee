"""Check mode: every size-setting argument is agreed, and a local error becomes everyone's.

Each case makes one rank differ in one argument that sets a message size or changes the result
(conv kernel, stride, padding, padding mode, bias shape; pooling window; interpolation scale;
group norm eps; halo widths; attention scale; a middle entry of cu_seqlens; dispatch_plan's
num_experts and expert_sizes; USP arguments across the ring dim of a 2-D mesh) or fail a local
check the others pass (a non-tensor input, a bad argument type, a bad routing tensor, weights
or groups that do not fit); with the check mode on, every rank must
raise the same error (type and message) and the group must stay usable.
"""

import pytest
import torch
import torch.distributed as dist

from harness.helpers import get_mesh, rank, world_group, world_size
from shardkit import RankMismatchError, ShardkitError, ShardkitTypeError, all_reduce_forward, all_to_all
from shardkit.comm import checks
from shardkit.context_parallel import ring_attention, ulysses_attention, usp_attention, usp_indices
from shardkit.expert_parallel import dispatch_plan, token_combine, token_dispatch
from shardkit.spatial import (
    halo_exchange,
    spatial_avg_pool,
    spatial_conv1d,
    spatial_group_norm,
    spatial_interpolate,
    spatial_max_pool,
)


def _same_error_everywhere(expected_type, fragment, fn, group=None):
    group = group or world_group()
    with checks(True), pytest.raises(expected_type, match=fragment) as info:
        fn()
    outcomes = [None] * world_size()
    dist.all_gather_object(outcomes, (type(info.value).__name__, str(info.value)), group=world_group())
    assert all(o == outcomes[0] for o in outcomes), outcomes
    t = torch.ones(1)
    dist.all_reduce(t, group=world_group())  # still usable
    assert t.item() == world_size()
    return outcomes[0][1]


def _conv(**kw):
    r = rank()
    x = torch.zeros(1, 2, 4)
    args = dict(kernel=3, stride=1, padding=1, padding_mode="zeros")
    args.update({k: v[r] for k, v in kw.items()})
    w = torch.zeros(3, 2, args["kernel"])
    return lambda: spatial_conv1d(
        x,
        w,
        None,
        world_group(),
        2,
        stride=args["stride"],
        padding=args["padding"],
        padding_mode=args["padding_mode"],
        sizes=[4, 4],
    )


def _q(s=4, n=2, d=4):
    return torch.zeros(1, s, n, d)


CASES = {
    "conv_kernel": lambda: _conv(kernel=[3, 5]),
    "conv_stride": lambda: _conv(stride=[1, 2]),
    "conv_padding": lambda: _conv(padding=[1, 2]),
    "conv_padding_mode": lambda: _conv(padding_mode=["zeros", "circular"]),
    "halo_widths": lambda: lambda: halo_exchange(torch.zeros(2, 3), world_group(), 1, [1, 2][rank()], 1),
    "attention_scale": lambda: (
        lambda: ulysses_attention(_q(), _q(), _q(), world_group(), causal=True, seq_len=8, scale=[0.5, 0.25][rank()])
    ),
    "cu_seqlens_middle": lambda: (
        lambda: ring_attention(
            _q(4), _q(4), _q(4), world_group(), causal=True, cu_seqlens=[[0, 4, 6, 8], [0, 2, 6, 8]][rank()]
        )
    ),
    "num_experts": lambda: lambda: dispatch_plan(torch.zeros(3, 1, dtype=torch.long), [4, 5][rank()], world_group()),
    "expert_sizes": lambda: (
        lambda: dispatch_plan(
            torch.zeros(3, 1, dtype=torch.long), 4, world_group(), expert_sizes=[[2, 2], [3, 1]][rank()]
        )
    ),
    "conv_bias_shape": lambda: (
        lambda: spatial_conv1d(
            torch.zeros(1, 2, 4),
            torch.zeros(3, 2, 3),
            torch.zeros([3, 4][rank()]),
            world_group(),
            2,
            padding=1,
            sizes=[4, 4],
        )
    ),
    "pool_kernel": lambda: lambda: spatial_max_pool(torch.zeros(1, 2, 4), world_group(), 2, [2, 3][rank()], 1),
    "pool_padding": lambda: lambda: spatial_avg_pool(torch.zeros(1, 2, 4), world_group(), 2, 3, 1, [1, 0][rank()]),
    "interpolate_scale": lambda: (
        lambda: spatial_interpolate(torch.zeros(1, 2, 4), world_group(), 2, [2, 3][rank()], "linear")
    ),
    "group_norm_eps": lambda: (
        lambda: spatial_group_norm(torch.zeros(1, 4, 3), 2, None, None, world_group(), eps=[1e-5, 1e-3][rank()])
    ),
}


def _topk():
    return torch.zeros(3, 2) if rank() == 1 else torch.zeros(3, 2, dtype=torch.long)


def _combine_bad_weights():
    plan = dispatch_plan(torch.zeros(3, 2, dtype=torch.long), 2, world_group())
    rows, _ = token_dispatch(torch.zeros(3, 4), plan)
    return token_combine(rows, plan, torch.ones(3, [2, 3][rank()]))


# A bad argument that only one rank has, found before that rank has a tensor to agree on (or by
# a local check): in check mode rank 1 agrees with a placeholder row carrying its error.
LOCAL = {
    "not_a_tensor": (
        ShardkitTypeError,
        "expected a torch.Tensor",
        lambda: all_reduce_forward([torch.zeros(2), [0.0, 0.0]][rank()], world_group()),
    ),
    "gather_size_type": (
        ShardkitTypeError,
        "gather_size must be an int",
        lambda: all_to_all(torch.zeros(1, 4, 4), world_group(), 2, 1, gather_size=[8, 8.0][rank()]),
    ),
    "topk_dtype": (ShardkitTypeError, "integer tensor", lambda: dispatch_plan(_topk(), 4, world_group())),
    "num_experts_type": (
        ShardkitTypeError,
        "num_experts must be an int",
        lambda: dispatch_plan(torch.zeros(3, 2, dtype=torch.long), [4, 4.0][rank()], world_group()),
    ),
    "hidden_not_a_tensor": (
        ShardkitTypeError,
        "hidden must be a torch.Tensor",
        lambda: token_dispatch(
            [torch.zeros(3, 4), "h"][rank()], dispatch_plan(torch.zeros(3, 2, dtype=torch.long), 2, world_group())
        ),
    ),
    "combine_weights": (ShardkitError, "topk_weights must be", _combine_bad_weights),
    "group_norm_channels": (
        ShardkitError,
        "C divisible by num_groups",
        lambda: spatial_group_norm(torch.zeros(1, 4, 3), [2, 3][rank()], None, None, world_group()),
    ),
}


@pytest.mark.world(2)
@pytest.mark.parametrize("case", sorted(LOCAL))
def test_one_ranks_own_argument_error_is_raised_everywhere(case):
    error, fragment, fn = LOCAL[case]
    msg = _same_error_everywhere(error, fragment, fn)
    assert "raised on rank 1 of 2; the check mode raised it on every rank" in msg


@pytest.mark.world(2)
@pytest.mark.parametrize("case", sorted(CASES))
def test_size_setting_argument_is_agreed(case):
    _same_error_everywhere(RankMismatchError, "disagree on arguments", CASES[case]())


@pytest.mark.world(2)
def test_op_identity_is_agreed():
    def fn():
        q = _q()
        if rank() == 0:
            return ulysses_attention(q, q, q, world_group(), causal=True, seq_len=8)
        return ring_attention(q, q, q, world_group(), causal=True, seq_len=8, layout="contiguous")

    msg = _same_error_everywhere(RankMismatchError, "disagree on op", fn)
    assert "rank 0: ulysses_attention; rank 1: ring_attention" in msg


@pytest.mark.world(2)
@pytest.mark.parametrize("op", ["ulysses", "ring"])
def test_local_error_on_one_rank_is_raised_on_every_rank(op):
    q = _q()
    k = _q(d=[4, 3][rank()])  # rank 1's k has another head dim: only rank 1 can see it
    fn = {
        "ulysses": lambda: ulysses_attention(q, k, k, world_group(), causal=True, seq_len=8),
        "ring": lambda: ring_attention(q, k, k, world_group(), causal=True, seq_len=8, layout="contiguous"),
    }[op]
    msg = _same_error_everywhere(ShardkitError, "head dims differ", fn)
    assert "raised on rank 1 of 2; the check mode raised it on every rank" in msg


@pytest.mark.world(2)
def test_local_type_error_keeps_its_type():
    q = _q()
    k = q.to(torch.float64) if rank() == 0 else q
    _same_error_everywhere(
        ShardkitTypeError,
        "share one floating dtype",
        lambda: ulysses_attention(q, k, k, world_group(), causal=True, seq_len=8),
    )


def _usp_case(mesh, scale=None, dtype=torch.float64):
    i, j = mesh["cp_ring"].get_local_rank(), mesh["cp_ulysses"].get_local_rank()
    n = len(usp_indices([0, 8], 2, 2, i, j))
    q = torch.zeros(1, n, 2, 4, dtype=torch.float64)
    k = q.to(dtype)
    return lambda: usp_attention(q, k, k, mesh, causal=True, seq_len=8, scale=scale)


@pytest.mark.world(4)
def test_usp_agrees_across_the_ring_dim():
    """Ring rank 1 (both its Ulysses ranks) uses another scale: each Ulysses group agrees with
    itself, so only the agreement over the ring dim sees it; every rank of the mesh raises it."""
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    scale = [0.5, 0.25][mesh["cp_ring"].get_local_rank()]
    _same_error_everywhere(RankMismatchError, "disagree on arguments", _usp_case(mesh, scale=scale))


@pytest.mark.world(4)
def test_usp_local_error_on_one_rank_reaches_the_whole_mesh():
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    dtype = torch.float32 if rank() == 3 else torch.float64
    msg = _same_error_everywhere(ShardkitTypeError, "share one floating dtype", _usp_case(mesh, dtype=dtype))
    assert "raised on rank 1 of 2" in msg  # rank 3 is Ulysses rank 1 of its group


@pytest.mark.world(4)
def test_usp_disagreement_inside_one_ulysses_group_is_one_text_on_the_mesh():
    """Rank 1 alone uses another scale: its Ulysses group (ranks 0, 1) sees it, the other does
    not; every rank of the mesh must still raise one text (the ring dim's verdict)."""
    mesh = get_mesh((2, 2), ("cp_ring", "cp_ulysses"))
    scale = 0.25 if rank() == 1 else 0.5
    _same_error_everywhere(RankMismatchError, "disagree on arguments", _usp_case(mesh, scale=scale))
