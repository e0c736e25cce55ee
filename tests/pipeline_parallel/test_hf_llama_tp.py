"""Hugging Face Llama pipeline stages with stage-local Megatron TP of different sizes (VTP):
1F1B loss and every (gathered) parameter gradient against the full model (float64, rtol 1e-9)."""

import copy

import pytest
import torch

from harness.helpers import all_true, rank, subgroup, world_group
from shardkit.cli.config import TrainConfig
from shardkit.cli.lm_task import causal_lm_loss
from shardkit.cli.model import build_model
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import PipelineStage, gpipe_schedule, one_f_one_b_schedule, run_schedule
from shardkit.pipeline_parallel.hf_llama import LlamaStageModule
from shardkit.pipeline_parallel.hf_llama_tp import apply_llama_stage_tp, check_llama_stage_tp
from shardkit.pipeline_parallel.vtp import StageGroups
from shardkit.tensor_parallel import gather_full_grads


def _model():
    return build_model(TrainConfig(dtype="float64", layers=3, hidden_size=32, heads=4, kv_heads=2,
                                   intermediate_size=64))


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("stage_ranks,schedule", [([[0, 1], [2], [3]], one_f_one_b_schedule),
                                                  ([[0, 1], [2, 3]], gpipe_schedule)], ids=["2-1-1", "2-2"])
def test_llama_vtp_pipeline_matches_full_model(stage_ranks, schedule):
    tps = [subgroup(tuple(r)) for r in stage_ranks]
    s = next(s for s, r in enumerate(stage_ranks) if rank() in r)
    groups, P = StageGroups(world_group(), stage_ranks, tps[s]), len(stage_ranks)
    full = _model()
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, 256, (2, S), generator=gen) for S in (9, 12, 7)]  # varying sequence length
    ref = [causal_lm_loss(full(input_ids=x).logits, x) for x in mbs]
    (sum(ref) / len(ref)).backward()

    module = apply_llama_stage_tp(LlamaStageModule(copy.deepcopy(full), s, P), tps[s])
    module.zero_grad()
    stage = PipelineStage(module, groups, s, P, loss_fn=causal_lm_loss if s == P - 1 else None)
    losses = run_schedule(stage, schedule(P, len(mbs)), mbs, mbs)
    ok = s < P - 1 or all(torch.allclose(a, b.detach(), rtol=1e-9, atol=0) for a, b in zip(losses, ref))
    ref_params = dict(full.named_parameters())
    for name, g in gather_full_grads(module).items():
        ok &= g is not None and torch.allclose(g, ref_params[name].grad, rtol=1e-9, atol=1e-14)
    assert all_true(bool(ok))


def test_stage_tp_must_divide_heads():
    from types import SimpleNamespace

    with pytest.raises(ShardkitError, match="tp=3 must divide num_attention_heads=4"):
        check_llama_stage_tp(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 3)
    check_llama_stage_tp(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 2)
