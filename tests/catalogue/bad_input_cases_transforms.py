"""Catalogue cases of the model transforms: apply_tp, apply_spatial, parallelize.

Their input is a model and a plan. Ranks whose plans or weights differ (a per-rank seed) differ
in data, not metadata: those cases are the opt-in fingerprint's (``fingerprint=True``); the
check mode is not expected to see them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bad_input_cases_comm import block, per_rank
from bad_input_rank import Registry, follow, rank, world
from torch import nn

from shardkit import ParallelDims, apply_spatial, apply_tp, balanced_split_sizes, parallelize

CASES = Registry(__name__)


class MLP(nn.Module):
    def __init__(self, hidden=6, inner=10, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(hidden, inner).double()
        self.down = nn.Linear(inner, hidden).double()

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def _tp(plan=None, seed=0, x=None, inner=10):
    plan = plan or {"up": "colwise", "down": "rowwise"}
    ref = MLP(inner=inner)
    model = apply_tp(MLP(inner=inner, seed=seed), world(), plan)
    x = _x(2, 6) if x is None else x
    return model(x), ref(x)


for _n in (1, 2, 3):
    CASES.add(f"apply_tp_control_r{_n}", _n, "apply_tp", "control", lambda: _tp())
CASES.add("apply_tp_uneven_inner_r3", 3, "apply_tp", "control", lambda: _tp(inner=7))
CASES.add("apply_tp_unknown_style_r2", 2, "apply_tp", "arg", lambda: _tp({"up": "diagonal", "down": "rowwise"}))
CASES.add(
    "apply_tp_unknown_style_one_rank_r2",
    2,
    "apply_tp",
    "plan",
    lambda: _tp({"up": per_rank(["colwise", "diagonal"]), "down": "rowwise"}),
    fingerprint=True,
)
CASES.add(
    "apply_tp_plan_differs_r2",
    2,
    "apply_tp",
    "plan",
    lambda: _tp(per_rank([{"up": "colwise", "down": "rowwise"}, {"up": "colwise"}])),
    fingerprint=True,
)
CASES.add("apply_tp_seed_differs_r2", 2, "apply_tp", "weights", lambda: _tp(seed=rank()), fingerprint=True)
CASES.add("apply_tp_input_differs_r2", 2, "apply_tp", "inputs", lambda: _tp(x=_x(2, 6) + rank()), fingerprint=True)
CASES.add("apply_tp_batch_differs_r2", 2, "apply_tp", "shape", lambda: _tp(x=_x(per_rank([2, 3]), 6)))
CASES.add("apply_tp_not_a_module_r2", 2, "apply_tp", "arg", lambda: (apply_tp("model", world(), {}), None))


def _convs(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.GELU(), nn.Conv1d(3, 2, 5, padding=2)).double()


def _spatial(sizes=None, dim=2, seed=0, L=12):
    ref = _convs()
    n = torch.distributed.get_world_size()
    sizes = sizes or balanced_split_sizes(L, n)
    full = _x(1, 2, sum(sizes))
    model = apply_spatial(_convs(seed), world(), dim)
    return model(block(full, 2, sizes)), block(ref(full), 2, sizes)


for _n in (1, 2, 3):
    CASES.add(f"apply_spatial_control_r{_n}", _n, "apply_spatial", "control", lambda: _spatial())
CASES.add("apply_spatial_uneven_r3", 3, "apply_spatial", "uneven", lambda: _spatial([7, 0, 5]))
CASES.add("apply_spatial_dim_differs_r2", 2, "apply_spatial", "dim", lambda: _spatial(dim=per_rank([2, 1])))
CASES.add("apply_spatial_dim_not_int_r2", 2, "apply_spatial", "arg", lambda: _spatial(dim="w"))
CASES.add(
    "apply_spatial_seed_differs_r2", 2, "apply_spatial", "weights", lambda: _spatial(seed=rank()), fingerprint=True
)


def _llama(seed=0, heads=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=2,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).double()


def _parallelize(seed=0, heads=4):
    world()
    mesh = ParallelDims(tp=2).build_mesh("cpu")
    follow(mesh["tp"])
    ids = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(1))
    want = _llama()(input_ids=ids).logits
    pm = parallelize(_llama(seed, heads), mesh)
    return pm.module(input_ids=ids).logits, want


CASES.add("parallelize_tp2_control", 2, "parallelize", "control", lambda: _parallelize())
CASES.add(
    "parallelize_tp2_seed_differs", 2, "parallelize", "weights", lambda: _parallelize(seed=rank()), fingerprint=True
)
CASES.add(
    "parallelize_heads_differ",
    2,
    "parallelize",
    "weights",
    lambda: _parallelize(heads=per_rank([4, 2])),
    fingerprint=True,
)
