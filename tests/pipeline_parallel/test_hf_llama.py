"""Pipeline stages of a Hugging Face Llama: the layer split rule, and a 2-stage pipeline's loss
and gradients against the full model (float64, rtol 1e-9)."""

import copy

import pytest
import torch

from harness.helpers import all_true, rank, world_group, world_size
from shardkit.cli.config import TrainConfig
from shardkit.cli.lm_task import causal_lm_loss
from shardkit.cli.model import build_model
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import PipelineStage, one_f_one_b_schedule, run_schedule, split_microbatches
from shardkit.pipeline_parallel.hf_llama import LlamaStageModule, check_llama_pp, llama_stage_layers


@pytest.mark.parametrize("L,P,expected", [
    (4, 1, [(0, 4)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    (5, 2, [(0, 3), (3, 5)]),
    (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
])
def test_stage_layer_split(L, P, expected):
    ranges = llama_stage_layers(L, P)
    assert [(r.start, r.stop) for r in ranges] == expected
    assert [i for r in ranges for i in r] == list(range(L))  # contiguous, covers every layer once


def test_stage_layer_split_errors():
    with pytest.raises(ShardkitError, match="3 decoder layers cannot fill 4 pipeline stages"):
        llama_stage_layers(3, 4)
    with pytest.raises(ShardkitError, match="num_stages must be an int >= 1"):
        llama_stage_layers(3, 0)
    from types import SimpleNamespace

    with pytest.raises(ShardkitError, match="tie_word_embeddings"):
        check_llama_pp(SimpleNamespace(num_hidden_layers=2, tie_word_embeddings=True), 2)


def _model():
    return build_model(TrainConfig(dtype="float64", layers=3, hidden_size=32, intermediate_size=64))


def test_stages_chain_to_the_full_model():
    model = _model()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    h = ids
    stages = [LlamaStageModule(model, s, 3) for s in range(3)]
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(input_ids=ids).logits)
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # full names, each once


@pytest.mark.world(2, timeout=60)
def test_two_stage_llama_pipeline_matches_full_model():
    s, P = rank(), world_size()
    full = _model()
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    ref_loss = causal_lm_loss(full(input_ids=ids).logits, ids)
    ref_loss.backward()

    module = LlamaStageModule(copy.deepcopy(full), s, P)
    stage = PipelineStage(module, world_group(), s, P, loss_fn=causal_lm_loss if s == P - 1 else None)
    mbs = split_microbatches(ids, 2)
    losses = run_schedule(stage, one_f_one_b_schedule(P, 2), mbs, mbs)
    ok = s < P - 1 or torch.allclose(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-9, atol=0)
    ref_params = dict(full.named_parameters())
    for name, p in module.named_parameters():
        ok &= p.grad is not None and torch.allclose(p.grad, ref_params[name].grad, rtol=1e-9, atol=1e-15)
    assert all_true(bool(ok))
