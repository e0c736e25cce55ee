"""Tensor + sequence parallel Llama (shardkit.tensor_parallel) against the unsharded model.

Parity (docs/design.md, Testing): the TP+SP model and the plain HF model built from the same seed,
float64, get the same logits, loss and every parameter gradient (gathered from the shards) to
rtol 1e-9 -- measured at about 1e-15. Sequence lengths include ones not divisible by tp.
"""

import pytest
import torch
from torch import nn

from harness.helpers import get_mesh, rank, world_group
from shardkit import CommLedger, ShardkitError
from shardkit.cli.loop import causal_lm_loss
from shardkit.cli.model import keep_norms_in_input_dtype
from shardkit.tensor_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    apply_llama_tp,
    check_llama_tp,
    gather_full_grads,
    gather_full_state_dict,
    shard_spec,
)

RTOL = 1e-9


def _llama(vocab=101, heads=4, kv_heads=2, seed=0):
    """A tiny float64 GQA Llama; uneven vocab (101) and intermediate (45) splits over tp=2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=45, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, use_cache=False,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).double()
    # HF's RMSNorm rounds to float32; keep float64 so that parity is at float64 rounding level.
    keep_norms_in_input_dtype(model)
    return model


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def _ids(batch, seq, vocab=101):
    # The same tokens on every rank: a fixed generator, not the per-test global seed.
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seq))


def _forward_backward(model, ids):
    out = model(input_ids=ids)
    loss = causal_lm_loss(out.logits, ids)
    loss.backward()
    return out.logits.detach(), loss.detach()


def _grad_errors(ref, full_grads):
    return {name: _rel(full_grads[name], p.grad) for name, p in ref.named_parameters()}


@pytest.mark.world(2)
@pytest.mark.parametrize("seq", [16, 13, 3])
def test_parity_tp2(seq):
    ref, model = _llama(), _llama()
    apply_llama_tp(model, world_group())  # a ProcessGroup works as well as a mesh
    ids = _ids(2, seq)
    ref_logits, ref_loss = _forward_backward(ref, ids)
    logits, loss = _forward_backward(model, ids)
    errors = _grad_errors(ref, gather_full_grads(model))
    assert logits.shape == ref_logits.shape
    assert _rel(logits, ref_logits) <= RTOL
    assert abs(loss - ref_loss) <= RTOL * abs(ref_loss)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, (worst, errors[worst])


@pytest.mark.world(4)
@pytest.mark.parametrize("seq", [16, 13])
def test_parity_tp2_dp2_ddp(seq):
    """tp=2 x dp=2 with DDP over mesh["dp"]: the norm weights' tp gradient hook runs before
    DDP's reducer, so DDP averages tp-summed gradients; the result is the full-batch gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = get_mesh((2, 2), ("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    ref, model = _llama(), _llama()
    ddp = DDP(apply_llama_tp(model, mesh["tp"]), process_group=mesh["dp"].get_group())
    ids = _ids(4, seq)
    ref_logits, ref_loss = _forward_backward(ref, ids)
    local = ids[2 * dp_rank : 2 * dp_rank + 2]
    logits, loss = _forward_backward(ddp, local)
    errors = _grad_errors(ref, gather_full_grads(ddp))
    assert _rel(logits, ref_logits[2 * dp_rank : 2 * dp_rank + 2]) <= RTOL
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, (worst, errors[worst])


@pytest.mark.world(2)
def test_comm_budget_and_shards():
    """Per layer: 2 sequence all-gathers and 2 reduce-scatters forward, their adjoints backward,
    2 norm-gradient all-reduces; plus the split, lm_head's gathers and the final norm."""
    model = _llama()
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    apply_llama_tp(model, world_group())
    q = model.model.layers[0].self_attn.q_proj.weight
    assert tuple(q.shape) == (16, 32) and shard_spec(q).sizes == (16, 16)  # 2 of 4 heads x 8
    assert model.lm_head.weight.shape[0] == (51 if rank() == 0 else 50)
    assert model.model.layers[0].mlp.down_proj.in_features == (23 if rank() == 0 else 22)
    gathered = gather_full_state_dict(model)
    assert all(torch.equal(gathered[name], t) for name, t in full.items())

    ids = _ids(2, 13)
    with CommLedger() as fwd:
        logits = model(input_ids=ids).logits
    with CommLedger() as bwd:
        causal_lm_loss(logits, ids).backward()
    layers = 2
    assert fwd.count(api="all_gather") == 2 * layers + 1
    assert fwd.count(api="reduce_scatter") == 2 * layers
    assert fwd.count(api="gather_forward_split_backward") == 1
    assert fwd.count() == 4 * layers + 2  # the split itself does not communicate
    assert bwd.count(api="all_gather", phase="backward") == 2 * layers + 1
    assert bwd.count(api="reduce_scatter", phase="backward") == 2 * layers
    assert bwd.count(api="split_forward_gather_backward", phase="backward") == 1
    assert bwd.count(api="sum_grad_over", phase="backward") == 2 * layers + 1
    assert bwd.count() == 6 * layers + 3


@pytest.mark.world(2)
def test_linear_styles_with_bias():
    """Megatron MLP on plain nn.Linear with biases: colwise bias is sharded, the rowwise bias
    is added once after the all-reduce, the input gradient is summed (f)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 5)).double()
    model = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 5)).double()
    model.load_state_dict(ref.state_dict())
    ColwiseParallel([6, 4]).apply(model[0], world_group())
    RowwiseParallel([6, 4]).apply(model[2], world_group())
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y = model(x_tp)  # the colwise style applies Megatron's f: it sums the input gradient
    y_ref.square().sum().backward()
    y.square().sum().backward()
    grads = gather_full_grads(model)
    assert _rel(y.detach(), y_ref.detach()) <= RTOL
    assert _rel(x_tp.grad, x_ref.grad) <= RTOL
    assert all(_rel(grads[n], p.grad) <= RTOL for n, p in ref.named_parameters())
    assert model[0].bias.shape[0] == (6 if rank() == 0 else 4) and model[2].bias.shape == (5,)


@pytest.mark.world(1)
def test_tp1_leaves_model_unchanged():
    model = _llama()
    params = dict(model.named_parameters())
    assert apply_llama_tp(model, world_group()) is model
    assert dict(model.named_parameters()) == params
    assert not model.model.layers[0]._forward_pre_hooks and shard_spec(params["lm_head.weight"]) is None


@pytest.mark.world(2)
def test_heads_not_divisible_raise_on_every_rank():
    model = _llama(heads=4, kv_heads=1)
    with pytest.raises(ShardkitError, match="num_key_value_heads=1"):
        apply_llama_tp(model, world_group())


def test_check_llama_tp_pure():
    from transformers import LlamaConfig

    def config(heads, kv_heads, tied=False):
        return LlamaConfig(hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied)

    check_llama_tp(config(6, 3), 3)
    check_llama_tp(config(6, 3, tied=True), 1)  # tp=1: nothing is split, anything goes
    with pytest.raises(ShardkitError, match="num_attention_heads=6"):
        check_llama_tp(config(6, 3), 2)
    with pytest.raises(ShardkitError, match="tie_word_embeddings"):
        check_llama_tp(config(4, 2, tied=True), 2)
