"""Expert-parallel style names live in expert_parallel (issue 20: tensor_parallel no longer imports
it): ``ep_plan`` hands them to ``apply_tp`` as style objects, ``styles=ep_styles()`` adds them by
name, and tensor parallelism's own table names the way when it meets one."""

from types import SimpleNamespace

import pytest
from torch import nn

from shardkit.errors import ShardkitError
from shardkit.expert_parallel import EpDispatchExperts, EpRouter, GroupedGemm, ep_plan, ep_styles
from shardkit.tensor_parallel import default_styles, verify_tp_plan


class _Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.gate = nn.Linear(4, 2)
        self.model.experts = nn.Linear(4, 4)
        self.base_model_prefix = "model"
        self.config = SimpleNamespace(
            base_model_tp_plan={"gate": "colwise", "experts": "moe_tp_experts"},
            base_model_ep_plan={
                "gate": "ep_router",
                "experts": "ep_dispatch_experts",
                "experts.weight": "grouped_gemm",
            },
        )


def test_ep_plan_gives_the_expert_parallel_styles_as_objects():
    plan = ep_plan(_Moe())
    assert isinstance(plan["model.gate"], EpRouter)
    assert isinstance(plan["model.experts"], EpDispatchExperts)
    assert isinstance(plan["model.experts.weight"], GroupedGemm)
    assert verify_tp_plan(_Moe(), plan).unused_rules == ()


def test_tensor_parallel_table_has_no_expert_parallel_names_and_says_where_they_are():
    assert not set(ep_styles()) & set(default_styles())
    plan = {"model.gate": "ep_router"}
    with pytest.raises(ShardkitError, match=r"unknown style 'ep_router'.*ep_styles\(\).*ep_plan\(model\)"):
        verify_tp_plan(_Moe(), plan)
    assert verify_tp_plan(_Moe(), plan, styles=ep_styles()).unused_rules == ()
