"""apply_tp's plan warning (issue 23, item 6): silent on a stock Llama's own plan (its norms stay
replicated by design), still raised for a parameter a plan really leaves out."""

from __future__ import annotations

import warnings

import pytest

from harness.helpers import all_true, rank, world_group
from shardkit import apply_tp

pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _warnings(**kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_tp(_llama(), world_group(), **kwargs)
    return [str(w.message) for w in caught]


@pytest.mark.world(2)
def test_a_stock_llama_own_plan_warns_nothing():
    messages = _warnings()
    assert all_true(not messages), messages


@pytest.mark.world(2)
def test_a_parameter_the_plan_leaves_out_is_still_named():
    plan = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    messages = _warnings(plan=plan)

    if rank() == 0:  # the report is said once, by rank 0
        assert len(messages) == 1 and "model.layers.*.mlp.gate_proj.weight" in messages[0]
        assert "input_layernorm" not in messages[0]
    else:
        assert not messages
