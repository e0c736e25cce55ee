"""Catalogue cases of expert parallelism: dispatch_plan, token_dispatch, token_combine.

Identity experts make the round trip checkable: ``combine(dispatch(h))`` with weights ``w`` is
``h * w.sum(1)`` for every rank's own tokens, whatever the routing.
"""

from __future__ import annotations

import torch
from bad_input_cases_comm import coords, per_rank
from bad_input_rank import Registry, rank, world

from shardkit import balanced_split_sizes, dispatch_plan, token_combine, token_dispatch

CASES = Registry(__name__)
H = 3


def routing(T, k, E, seed=0):
    gen = torch.Generator().manual_seed(100 * rank() + seed)
    return torch.randint(0, E, (T, k), generator=gen)


def _round_trip(E=6, T=None, k=2, expert_sizes=None, weighted=True):
    T = per_rank([5, 0, 3, 4]) if T is None else T
    idx = routing(T, k, E)
    h = coords(T, H, offset=100.0 * rank() + 1)
    w = torch.rand(T, k, generator=torch.Generator().manual_seed(rank()), dtype=torch.float64)
    plan = dispatch_plan(idx, E, world(), expert_sizes=expert_sizes)
    rows, _ = token_dispatch(h, plan)
    out = token_combine(rows, plan, w if weighted else None)
    return out, h * (w.sum(1, keepdim=True) if weighted else k)


def _plan_counts(E=6, k=2, n=2):
    """The plan's rows per local expert against counts computed from every rank's routing."""
    plan = dispatch_plan(routing(4, k, E), E, world())
    sizes = balanced_split_sizes(E, n)
    lo = sum(sizes[: rank()])
    want = [0] * sizes[rank()]
    me = rank()
    for src in range(n):
        gen = torch.Generator().manual_seed(100 * src)
        idx = torch.randint(0, E, (4, k), generator=gen)
        for e in idx.view(-1).tolist():
            if lo <= e < lo + sizes[me]:
                want[e - lo] += 1
    return list(plan.tokens_per_local_expert), want


for _n in (1, 2, 3, 4):
    CASES.add(f"ep_round_trip_control_r{_n}", _n, "token_dispatch/token_combine", "control", lambda: _round_trip())
CASES.add("ep_round_trip_unweighted_r2", 2, "token_combine", "control", lambda: _round_trip(weighted=False))
CASES.add("ep_round_trip_few_experts_r3", 3, "token_dispatch/token_combine", "control", lambda: _round_trip(E=2))
CASES.add("ep_round_trip_expert_sizes_r3", 3, "dispatch_plan", "control", lambda: _round_trip(expert_sizes=[4, 0, 2]))
CASES.add(
    "ep_round_trip_top_k_differs_r2", 2, "dispatch_plan", "shape", lambda: (_round_trip(k=per_rank([1, 3]))[0], None)
)
CASES.add("ep_round_trip_no_tokens_anywhere_r2", 2, "token_dispatch/token_combine", "control", lambda: _round_trip(T=0))
CASES.add("dispatch_plan_counts_r2", 2, "dispatch_plan", "control", lambda: _plan_counts())
CASES.add("dispatch_plan_counts_r3", 3, "dispatch_plan", "control", lambda: _plan_counts(E=7, n=3))


def _plan_bad(idx=None, E=4, expert_sizes=None):
    idx = routing(3, 2, 4) if idx is None else idx
    return dispatch_plan(idx, E, world(), expert_sizes=expert_sizes), None


_PLAN_BAD = {
    "num_experts_differs_r2": (2, lambda: _plan_bad(E=per_rank([4, 5]))),
    "num_experts_differs_r3": (3, lambda: _plan_bad(E=per_rank([4, 4, 6]))),
    "num_experts_zero_r2": (2, lambda: _plan_bad(E=0)),
    "num_experts_float_r2": (2, lambda: _plan_bad(E=4.0)),
    "num_experts_float_one_rank_r2": (2, lambda: _plan_bad(E=per_rank([4, 4.0]))),
    "expert_sizes_differ_r2": (2, lambda: _plan_bad(expert_sizes=per_rank([[2, 2], [3, 1]]))),
    "expert_sizes_wrong_sum_r2": (2, lambda: _plan_bad(expert_sizes=[2, 3])),
    "expert_sizes_wrong_length_r3": (3, lambda: _plan_bad(expert_sizes=[2, 2])),
    "expert_sizes_negative_r2": (2, lambda: _plan_bad(expert_sizes=[5, -1])),
    "expert_id_out_of_range_one_rank_r2": (2, lambda: _plan_bad(idx=torch.tensor([[0, per_rank([1, 9])]]))),
    "expert_id_negative_one_rank_r3": (3, lambda: _plan_bad(idx=torch.tensor([[0, per_rank([1, 1, -1])]]))),
    "topk_float_one_rank_r2": (
        2,
        lambda: _plan_bad(idx=per_rank([torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)])),
    ),
    "topk_1d_one_rank_r2": (
        2,
        lambda: _plan_bad(idx=per_rank([torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long)])),
    ),
    "topk_not_tensor_one_rank_r2": (
        2,
        lambda: _plan_bad(idx=per_rank([torch.zeros(3, 2, dtype=torch.long), [[0, 1]]])),
    ),
    "topk_int32_vs_int64_r2": (2, lambda: _plan_bad(idx=torch.zeros(3, 2, dtype=per_rank([torch.long, torch.int32])))),
}
for _name, (_n, _body) in _PLAN_BAD.items():
    CASES.add(f"dispatch_plan_{_name}", _n, "dispatch_plan", "arg", _body)


def _dispatch_bad(hidden_fn):
    plan = dispatch_plan(routing(3, 2, 4), 4, world())
    return token_dispatch(hidden_fn(), plan), None


def _combine_bad(rows_fn=None, weights_fn=None):
    plan = dispatch_plan(routing(3, 2, 4), 4, world())
    rows, _ = token_dispatch(coords(3, H), plan)
    rows = rows if rows_fn is None else rows_fn(rows)
    w = None if weights_fn is None else weights_fn()
    return token_combine(rows, plan, w), None


_ROWS_BAD = {
    "dispatch_hidden_rows_wrong_one_rank_r2": lambda: _dispatch_bad(lambda: coords(per_rank([3, 4]), H)),
    "dispatch_hidden_width_differs_r2": lambda: _dispatch_bad(lambda: coords(3, per_rank([H, H + 1]))),
    "dispatch_hidden_dtype_differs_r2": lambda: _dispatch_bad(
        lambda: coords(3, H, dtype=per_rank([torch.float64, torch.float32]))
    ),
    "dispatch_hidden_3d_one_rank_r2": lambda: _dispatch_bad(lambda: coords(*per_rank([(3, H), (3, H, 1)]))),
    "dispatch_hidden_not_tensor_one_rank_r2": lambda: _dispatch_bad(lambda: per_rank([coords(3, H), "hidden"])),
    "dispatch_plan_not_a_plan_one_rank_r2": lambda: (
        token_dispatch(coords(3, H), per_rank([dispatch_plan(routing(3, 2, 4), 4, world()), {}])),
        None,
    ),
    "combine_rows_dropped_one_rank_r2": lambda: _combine_bad(rows_fn=lambda r: r[1:] if rank() == 1 else r),
    "combine_width_differs_r2": lambda: _combine_bad(
        rows_fn=lambda r: torch.cat([r, r[:, :1]], 1) if rank() == 1 else r
    ),
    "combine_weights_wrong_shape_one_rank_r2": lambda: _combine_bad(
        weights_fn=lambda: torch.ones(3, per_rank([2, 3]), dtype=torch.float64)
    ),
    "combine_dtype_differs_r2": lambda: _combine_bad(rows_fn=lambda r: r.float() if rank() == 1 else r),
}
for _name, _body in _ROWS_BAD.items():
    CASES.add(
        _name,
        2,
        _name.split("_")[0].replace("dispatch", "token_dispatch").replace("combine", "token_combine"),
        "arg",
        _body,
    )
