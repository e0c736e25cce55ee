"""apply_tp on real Hugging Face models with their own plans, against the unsharded model.

Parity (docs/design.md, Testing): the same float64 model sharded by ``apply_tp`` and unsharded get the
same logits, loss and every parameter gradient (gathered from the shards) to rtol 1e-9, at tp 2,
3 and 4. The shapes (6 query / 2 KV heads, intermediate 10, vocab 101) make tp 3 and 4 split heads
unevenly, replicate KV heads and cut MLP and vocabulary shards with torch.chunk semantics.
"""

import pytest
import torch
from hf_models import assert_parity, build
from hf_models import causal_lm_loss_f64 as _causal_lm_loss_f64
from hf_models import ids as _ids
from hf_models import run as _run

from harness.helpers import rank, world_group
from shardkit import CommLedger
from shardkit.expert_parallel import ep_plan
from shardkit.tensor_parallel import apply_tp, shard_spec

RTOL = 1e-9
RTOL_OF: dict[str, float] = {}  # (DeepSeek-V2's float32 router and RoPE are made float64 by build())
RTOL_F32 = 1e-5
# "+ep": the MoE experts sharded by expert (the config's EP plan, all-to-all token dispatch)
# instead of tensor-parallel experts.
KINDS = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_moe+ep", "deepseek_v2", "deepseek_v2+ep"]


def _check_parity(kind, dtype=torch.float64, **apply_kwargs):
    kind, _, variant = kind.partition("+")
    rtol = RTOL_OF.get(kind, RTOL) if dtype == torch.float64 else RTOL_F32
    ref, model = build(kind, dtype=dtype), build(kind, dtype=dtype)
    plan = ep_plan(model) if variant == "ep" else None
    if apply_kwargs.get("loss_parallel"):
        # transformers' loss rounds logits to float32; the vocab-parallel loss keeps float64.
        ref.loss_function = _causal_lm_loss_f64
    apply_tp(model, world_group(), plan, check="off", **apply_kwargs)
    ids = _ids()
    assert_parity(ref, model, ids, rtol)
    return model


@pytest.mark.world(2)
@pytest.mark.parametrize("kind", KINDS)
def test_hf_parity_tp2(kind):
    _check_parity(kind)


@pytest.mark.world(3)
@pytest.mark.parametrize("kind", KINDS)
def test_hf_parity_tp3(kind):
    _check_parity(kind)


@pytest.mark.world(4)
@pytest.mark.parametrize("kind", KINDS)
def test_hf_parity_tp4(kind):
    _check_parity(kind)


@pytest.mark.world(4)
def test_kv_heads_replicated_when_fewer_than_ranks():
    """6 q / 2 kv heads on 4 ranks: q heads [2, 2, 1, 1]; rank 1 holds both KV heads (groups 1),
    the others one; the shared KV heads' gradients are summed over their holders."""
    model = build("llama")
    apply_tp(model, world_group(), check="off")
    attn = model.model.layers[0].self_attn
    spec = shard_spec(attn.k_proj.weight)
    assert spec.ranges == (((0, 8),), ((0, 16),), ((8, 16),), ((8, 16),)) and spec.overlapping
    assert attn.num_key_value_groups == [2, 1, 1, 1][rank()]
    assert attn.q_proj.out_features == [16, 16, 8, 8][rank()]
    # the MLP is cut with torch.chunk semantics: 10 -> [3, 3, 3, 1]
    assert model.model.layers[0].mlp.up_proj.weight.shape[0] == [3, 3, 3, 1][rank()]


@pytest.mark.world(2)
def test_collectives_per_llama_step():
    """Per layer: one f on the input q, k, v share and one on the input gate, up share (2 backward
    all-reduces) and g on o_proj and down_proj (2 forward all-reduces); plus the vocab-parallel
    embedding (1 forward all-reduce), the logits gather (1) and no others."""
    model = build("llama")
    apply_tp(model, world_group(), check="off")
    with CommLedger() as ledger:
        _run(model, _ids())
    fwd = ledger.count(phase="forward")
    bwd = ledger.count(phase="backward")
    layers = len(model.model.layers)
    assert fwd == 2 * layers + 2, ledger.summary()
    assert bwd == 2 * layers + 1, ledger.summary()


@pytest.mark.world(3)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_loss_parallel(kind):
    """loss_parallel: lm_head keeps vocab-sharded logits [B, S, V_r] (101 -> [34, 34, 33] by
    chunk) and HF's own labels= loss goes through vocab_parallel_cross_entropy; the loss and every
    gradient match the unsharded model."""
    model = _check_parity(kind, loss_parallel=True)
    assert model.lm_head.out_features == [34, 34, 33][rank()]
    logits = model(input_ids=_ids()).logits
    assert logits.shape[-1] == [34, 34, 33][rank()]


@pytest.mark.world(3)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe+ep"])
def test_hf_parity_float32(kind):
    _check_parity(kind, dtype=torch.float32)
