"""Pipeline stages of every supported Hugging Face decoder family (DecoderStageModule) against
the full model: the layer split rule, bitwise chaining, and 1F1B training at pp 2 and 3 (loss and
every parameter gradient, float64 rtol 1e-9), with position ids and layer keyword arguments
passed per microbatch, tensor (and sequence) parallelism inside stages, and tied embeddings.
"""

import copy
import importlib
import sys
from pathlib import Path

import pytest
import torch

from harness.helpers import all_true, get_mesh, rank, subgroup, world_group, world_size
from shardkit.errors import ShardkitError
from shardkit.parallelize import DecoderStageModule, decoder_stage_layers, sum_tied_embedding_grads
from shardkit.pipeline_parallel import (
    PipelineStage,
    StageGroups,
    gpipe_schedule,
    one_f_one_b_schedule,
    run_schedule,
)
from shardkit.tensor_parallel import apply_tp, gather_full_grads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tensor_parallel"))
from hf_models import VOCAB, build  # noqa: E402

RTOL = 1e-9
KINDS = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2"]


def _model(kind, layers=4, **kw):
    return build(kind, num_hidden_layers=layers, **kw)


def _loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _close(a, b):
    return a is not None and b is not None and torch.allclose(a, b, rtol=RTOL, atol=1e-15)


@pytest.mark.parametrize(
    "L,P,expected",
    [
        (4, 1, [(0, 4)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (5, 2, [(0, 3), (3, 5)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
    ],
)
def test_stage_layer_split(L, P, expected):
    ranges = decoder_stage_layers(L, P)
    assert [(r.start, r.stop) for r in ranges] == expected
    assert [i for r in ranges for i in r] == list(range(L))


def test_stage_layer_split_errors():
    with pytest.raises(ShardkitError, match="3 decoder layers cannot fill 4 pipeline stages"):
        decoder_stage_layers(3, 4)
    with pytest.raises(ShardkitError, match="num_stages must be an int >= 1"):
        decoder_stage_layers(3, 0)


# transformers' deprecation of the mask builders' `past_key_values` would break --pp on its removal:
# the stages must pass the new name, so any FutureWarning here is a failure.
@pytest.mark.filterwarnings("error::FutureWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_stages_chain_to_the_full_model(kind):
    model = _model(kind)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    stages = [DecoderStageModule(model, s, 3) for s in range(3)]
    h = ids
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(input_ids=ids).logits)
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # full names, each once
    assert stages[1].tp_plan and "lm_head" not in stages[1].tp_plan and "lm_head" in stages[2].tp_plan


@pytest.mark.filterwarnings("error::FutureWarning")
def test_position_ids_and_layer_kwargs_reach_the_layers():
    """Given position ids are used (not 0..S-1) and extra keywords reach every decoder layer."""
    model = _model("llama", layers=2)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6).unsqueeze(0) + 5
    seen = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("marker")), with_kwargs=True)
    h = ids
    for s in range(2):
        h = DecoderStageModule(model, s, 2)(h, position_ids=pos, marker="cp", use_cache=False)
    assert seen == ["cp", "cp"]
    assert torch.equal(h, model(input_ids=ids, position_ids=pos).logits)
    assert not torch.equal(h, model(input_ids=ids).logits)


def _pipeline_parity(kind, *, tied=False, positions=False):
    s, P = rank(), world_size()
    full = _model(kind, tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, VOCAB, (2, S), generator=gen) for S in (7, 5)]  # microbatches of different length
    pos = [torch.arange(x.shape[1]).unsqueeze(0) + 3 * m for m, x in enumerate(mbs)] if positions else None
    ref = [_loss(full(input_ids=x, position_ids=None if pos is None else pos[m]).logits, x) for m, x in enumerate(mbs)]
    (sum(ref) / len(ref)).backward()
    module = DecoderStageModule(copy.deepcopy(full), s, P)
    module.zero_grad()
    stage = PipelineStage(module, world_group(), s, P, loss_fn=_loss if s == P - 1 else None)
    kwargs = None if pos is None else [{"position_ids": p} for p in pos]
    losses = run_schedule(stage, one_f_one_b_schedule(P, len(mbs)), mbs, mbs, stage_kwargs=kwargs)
    if tied:
        sum_tied_embedding_grads(module, world_group())
    ok = s < P - 1 or all(torch.allclose(a, b.detach(), rtol=RTOL, atol=0) for a, b in zip(losses, ref))
    ref_params = dict(full.named_parameters(remove_duplicate=False))
    for name, p in module.named_parameters():
        ok &= _close(p.grad, ref_params[name].grad)
    return all_true(bool(ok))


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_pp2_matches_full_model(kind):
    assert _pipeline_parity(kind, positions=True)


@pytest.mark.world(3, timeout=120)
@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_pp3_matches_full_model(kind):
    assert _pipeline_parity(kind)


@pytest.mark.world(3, timeout=120)
def test_pipeline_tied_embeddings_pp3():
    """embed_tokens (stage 0) and lm_head (stage 2) share a weight: after the sum both copies hold
    the full model's gradient of the tied parameter; stage 1 takes no part."""
    assert _pipeline_parity("llama", tied=True)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize(
    "stage_ranks,schedule,kind,sp",
    [
        ([[0, 1], [2], [3]], one_f_one_b_schedule, "llama", False),
        ([[0, 1], [2, 3]], gpipe_schedule, "qwen3", False),
        ([[0, 1], [2, 3]], one_f_one_b_schedule, "llama", True),
        ([[0, 1], [2, 3]], one_f_one_b_schedule, "qwen3_moe", False),
    ],
    ids=["llama-2-1-1", "qwen3-2-2", "llama-2-2-sp", "moe-2-2"],
)
def test_pipeline_with_tp_stages(stage_ranks, schedule, kind, sp):
    """apply_tp(stage, tp) with the model's own plan (sequence-parallel inside the stages: the
    boundaries stay replicated), stages of different tp sizes, microbatches of different length."""
    tps = [subgroup(tuple(r)) for r in stage_ranks]
    s = next(s for s, r in enumerate(stage_ranks) if rank() in r)
    groups, P = StageGroups(world_group(), stage_ranks, tps[s]), len(stage_ranks)
    full = _model(kind, layers=3)
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, VOCAB, (2, S), generator=gen) for S in (9, 12, 7)]
    ref = [_loss(full(input_ids=x).logits, x) for x in mbs]
    (sum(ref) / len(ref)).backward()
    module = apply_tp(DecoderStageModule(copy.deepcopy(full), s, P), tps[s], check="off", sequence_parallel=sp)
    module.zero_grad()
    stage = PipelineStage(module, groups, s, P, loss_fn=_loss if s == P - 1 else None)
    losses = run_schedule(stage, schedule(P, len(mbs)), mbs, mbs)
    ok = s < P - 1 or all(torch.allclose(a, b.detach(), rtol=RTOL, atol=0) for a, b in zip(losses, ref))
    ref_params = dict(full.named_parameters())
    for name, g in gather_full_grads(module).items():
        ok &= _close(g, ref_params[name].grad)
    assert all_true(bool(ok))


@pytest.mark.world(4, timeout=240)
def test_pipeline_tp_sp_tied_embeddings_and_loss_parallel():
    """pp 2 x tp 2 (a (pp, tp) mesh), sequence parallel inside the stages, vocab-parallel loss on
    the last stage, tied embeddings: the vocab-row shards of embed_tokens (stage 0) and lm_head
    (stage 1) match per tp rank, and their gradients are summed over the pp group."""
    from shardkit.tensor_parallel import vocab_parallel_cross_entropy

    mesh = get_mesh((2, 2), ("pp", "tp"))
    s, tp = mesh["pp"].get_local_rank(), mesh["tp"]
    groups = StageGroups(world_group(), [[0, 1], [2, 3]], tp)
    full = _model("llama", tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(1)
    mbs = [torch.randint(0, VOCAB, (2, S), generator=gen) for S in (9, 7)]
    ref = [_loss(full(input_ids=x).logits, x) for x in mbs]
    (sum(ref) / len(ref)).backward()
    module = apply_tp(
        DecoderStageModule(copy.deepcopy(full), s, 2), tp, check="off", sequence_parallel=True, loss_parallel=True
    )
    module.zero_grad()

    def loss(logits, ids):
        return vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], tp)

    stage = PipelineStage(module, groups, s, 2, loss_fn=loss if s == 1 else None)
    losses = run_schedule(stage, one_f_one_b_schedule(2, len(mbs)), mbs, mbs)
    sum_tied_embedding_grads(module, mesh["pp"])
    ok = s == 0 or all(torch.allclose(a, b.detach(), rtol=RTOL, atol=0) for a, b in zip(losses, ref))
    ref_params = dict(full.named_parameters(remove_duplicate=False))
    for name, g in gather_full_grads(module).items():
        ok &= _close(g, ref_params[name].grad)
    assert all_true(bool(ok))


@pytest.mark.parametrize("name", ["DecoderStageModule", "decoder_stage_layers", "check_pp", "sum_tied_embedding_grads"])
def test_the_old_pipeline_parallel_names_still_work_with_a_warning(name):
    """Moved to shardkit.parallelize (issue 30): the old name is the same object for one release."""
    old, new = (importlib.import_module(f"shardkit.{m}") for m in ("pipeline_parallel", "parallelize"))
    with pytest.warns(DeprecationWarning, match=rf"{name} is deprecated: import it from shardkit\.parallelize"):
        assert getattr(old, name) is getattr(new, name)
    assert name not in old.__all__ and name in new.__all__
