"""keep_float64 replaces DeepSeek-V2's float32 rotary embedding per model, not process-wide."""

import copy

import pytest
import torch

from shardkit.train.model import keep_float64

tf = pytest.importorskip("transformers")
from transformers.models.deepseek_v2 import modeling_deepseek_v2  # noqa: E402


def _mla():
    config = tf.DeepseekV2Config(
        vocab_size=31,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        moe_intermediate_size=8,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"  # eager rounds its softmax to float32
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    return tf.DeepseekV2ForCausalLM(config).to(torch.float64)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_rotary_embedding_keeps_float64_in_this_model_only():
    kept = _mla()
    reference = copy.deepcopy(kept)
    global_before = modeling_deepseek_v2.apply_rotary_emb
    keep_float64(kept)
    assert modeling_deepseek_v2.apply_rotary_emb is global_before  # transformers' module untouched
    ids = torch.randint(0, 31, (2, 9))
    want = _logits(kept, ids)
    # the reference: the same replacements, but the attentions back on the class's forward
    keep_float64(reference)
    ours = reference.model.layers[0].self_attn.forward.__func__.__globals__["apply_rotary_emb"]
    for layer in reference.model.layers:
        del layer.self_attn.forward
    assert not torch.equal(_logits(reference, ids), want)  # float32 rotary: the test can fail
    modeling_deepseek_v2.apply_rotary_emb = ours  # the old, process-wide replacement
    try:
        assert torch.equal(_logits(reference, ids), want)
    finally:
        modeling_deepseek_v2.apply_rotary_emb = global_before
    assert torch.equal(_logits(copy.deepcopy(kept), ids), want)  # a copy (--verify's reference) keeps it
