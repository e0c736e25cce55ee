"""``apply_tp(..., sequence_parallel=True)``: Megatron sequence parallelism from the model's own
plan, against the unsharded model.

Parity (docs/design.md, Testing): float64 logits, loss and every parameter gradient (gathered from the
shards) to rtol 1e-9, for Llama, Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V2 (MLA, with and without
q_lora) at tp 2, 3 and 4 with a sequence length (7) that no tp size divides. Also: 9 query / 3 KV
heads (SmolLM2-135M's shape) and tied input/output embeddings, with and without sequence
parallelism; the exact collectives of a step; the refusal of expert-parallel experts.
"""

import pytest
import torch
from hf_models import VOCAB, assert_parity, causal_lm_loss_f64
from hf_models import build as _build
from hf_models import ids as _ids
from hf_models import rel as _rel
from hf_models import run as _run

from harness.helpers import get_mesh, rank, world_group
from shardkit import CommLedger, ShardkitError
from shardkit.tensor_parallel import apply_tp, check_tp, gather_full_grads, shard_spec

RTOL = 1e-9
KINDS = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v2+q_lora"]


def build(kind):
    """``hf_models.build``; ``deepseek_v2+q_lora``: MLA with a query LoRA (``q_a_proj``, replicated)."""
    kind, _, variant = kind.partition("+")
    return _build(kind, q_lora_rank=8) if variant == "q_lora" else _build(kind)


def _smol_like(tied: bool, seed=0):
    """SmolLM2-135M's head shape (9 query / 3 KV heads) and tied embeddings, tiny."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardkit.train.model import keep_norms_in_input_dtype

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=36,
        intermediate_size=10,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=4,
        use_cache=False,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).double()
    keep_norms_in_input_dtype(model)
    return model


def _parity(ref, model, tp_mesh, seq=7, **kwargs):
    apply_tp(model, tp_mesh, check="off", **kwargs)
    logits = assert_parity(ref, model, _ids(seq=seq), RTOL)
    assert logits.shape[-1] == VOCAB  # full logits: their parity was checked
    return model


@pytest.mark.world(2)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seq", [7, 8])
def test_sp_parity_tp2(kind, seq):
    _parity(build(kind), build(kind), world_group(), seq=seq, sequence_parallel=True)


@pytest.mark.world(3)
@pytest.mark.parametrize("kind", KINDS)
def test_sp_parity_tp3(kind):
    _parity(build(kind), build(kind), world_group(), sequence_parallel=True)


@pytest.mark.world(4)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seq", [7, 3])
def test_sp_parity_tp4(kind, seq):
    """seq 3 over 4 ranks: blocks [1, 1, 1, 0], one rank without tokens between blocks."""
    _parity(build(kind), build(kind), world_group(), seq=seq, sequence_parallel=True)


@pytest.mark.world(3)
def test_sp_with_loss_parallel():
    """Vocab-sharded logits [B, S, V_r] and the vocab-parallel loss on top of the SP plan."""
    ref, model = build("llama"), build("llama")
    ref.loss_function = causal_lm_loss_f64
    apply_tp(model, world_group(), check="off", sequence_parallel=True, loss_parallel=True)
    ids = _ids()
    _, ref_loss = _run(ref, ids)
    logits, loss = _run(model, ids)
    grads = gather_full_grads(model)
    assert logits.shape[-1] == [34, 34, 33][rank()] and _rel(loss, ref_loss) <= RTOL
    assert all(_rel(grads[n], p.grad) <= RTOL for n, p in ref.named_parameters())


@pytest.mark.world(2)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sp", [False, True])
def test_nine_three_heads_and_tied_embeddings_tp2(tied, sp):
    """9 query / 3 KV heads over 2 ranks: query heads [5, 4]; rank 0 uses KV heads 0 (x3) and 1
    (x2), so it holds KV heads [0, 0, 0, 1, 1] with one query head each."""
    model = _parity(_smol_like(tied), _smol_like(tied), world_group(), sequence_parallel=sp)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == [20, 16][rank()]
    assert shard_spec(attn.k_proj.weight).ranges[0] == ((0, 4), (0, 4), (0, 8), (4, 8))
    assert attn.num_key_value_groups == 1
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@pytest.mark.world(4)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sp", [False, True])
def test_nine_three_heads_and_tied_embeddings_tp4(tied, sp):
    _parity(_smol_like(tied), _smol_like(tied), world_group(), sequence_parallel=sp)


@pytest.mark.world(4)
@pytest.mark.parametrize("seq", [8, 7])
def test_sp_tp2_dp2_ddp(seq):
    """tp=2 x dp=2 with DDP over mesh["dp"]: the norm weights' tp gradient hook runs before
    DDP's reducer, so DDP averages tp-summed gradients; the result is the full-batch gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mesh = get_mesh((2, 2), ("dp", "tp"))
    d = mesh["dp"].get_local_rank()
    ref, model = build("llama"), build("llama")
    ddp = DDP(apply_tp(model, mesh["tp"], check="off", sequence_parallel=True), process_group=mesh["dp"].get_group())
    ids = _ids(4, seq)
    ref_logits, _ = _run(ref, ids)
    logits, _ = _run(ddp, ids[2 * d : 2 * d + 2])
    grads = gather_full_grads(ddp)
    assert _rel(logits, ref_logits[2 * d : 2 * d + 2]) <= RTOL
    # DDP averages the two dp halves' mean losses: the full-batch mean loss for equal halves.
    bad = {n: _rel(grads[n], p.grad) for n, p in ref.named_parameters() if _rel(grads[n], p.grad) > RTOL}
    assert not bad, bad


@pytest.mark.world(2)
def test_sp_collectives_per_step():
    """Per layer forward: one sequence all-gather for attention (shared by q/k/v) and one for the
    MLP (shared by gate/up), two reduce-scatters (o_proj, down_proj); plus the vocab-parallel
    embedding's all-reduce, lm_head's sequence gather and its logits gather. Backward: the
    adjoints (reduce-scatter per gather, all-gather per reduce-scatter, the split's gather) and
    the norm weights' gradient sums (2 per layer and the final norm)."""
    model = build("llama")
    apply_tp(model, world_group(), check="off", sequence_parallel=True)
    ids = _ids()
    with CommLedger() as fwd:
        out = model(input_ids=ids, labels=ids)
    with CommLedger() as bwd:
        out.loss.backward()
    L = len(model.model.layers)
    assert fwd.count(api="all_gather") == 2 * L + 1, fwd.summary()
    assert fwd.count(api="reduce_scatter") == 2 * L
    assert fwd.count(api="all_reduce_forward") == 1
    assert fwd.count(api="gather_forward_split_backward") == 1
    assert fwd.count() == 4 * L + 3
    assert bwd.count(api="all_gather", phase="backward") == 2 * L + 1, bwd.summary()
    assert bwd.count(api="reduce_scatter", phase="backward") == 2 * L
    assert bwd.count(api="split_forward_gather_backward") == 1
    assert bwd.count(api="sum_grad_over") == 2 * L + 1
    assert bwd.count() == 6 * L + 3


@pytest.mark.world(2)
def test_sp_moe_collectives_per_step():
    """Qwen3-MoE, layer 0 MoE and layer 1 dense (mlp_only_layers=[1]): per layer the same sequence
    gathers and reduce-scatters as a dense model (the MoE block reduce-scatters its partial
    output once), plus one f (all-reduce in backward) on the routing weights of the MoE layer."""
    model = build("qwen3_moe")
    apply_tp(model, world_group(), check="off", sequence_parallel=True)
    ids = _ids()
    with CommLedger() as fwd:
        out = model(input_ids=ids, labels=ids)
    with CommLedger() as bwd:
        out.loss.backward()
    assert fwd.count(api="all_gather") == 5 and fwd.count(api="reduce_scatter") == 4, fwd.summary()
    assert fwd.count(api="all_reduce_forward") == 1 and fwd.count() == 11
    assert bwd.count(api="all_reduce_backward") == 1, bwd.summary()
    # q_norm / k_norm (2 per layer) and the layer and final norms (5) sum their gradients.
    assert bwd.count(api="sum_grad_over") == 4 + 5


@pytest.mark.world(2)
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v2"])
def test_sp_refuses_expert_parallel_experts(kind):
    from shardkit.expert_parallel import ep_plan

    model = build(kind)
    with pytest.raises(ShardkitError, match="expert-parallel token dispatch"):
        apply_tp(model, world_group(), ep_plan(model), check="off", sequence_parallel=True)


@pytest.mark.world(1)
def test_tp1_leaves_model_unchanged():
    model = build("llama")
    params = dict(model.named_parameters())
    assert apply_tp(model, world_group(), check="off", sequence_parallel=True) is model
    assert dict(model.named_parameters()) == params
    assert not model.model.layers[0]._forward_pre_hooks and shard_spec(params["lm_head.weight"]) is None


def test_check_tp_pure():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=36, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    for tp in (1, 2, 3, 4, 9):
        check_tp(config, tp)
    with pytest.raises(ShardkitError, match="9 query heads cannot be split over tp=10"):
        check_tp(config, 10)
