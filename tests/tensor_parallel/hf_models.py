"""Tiny Hugging Face models built from configs with transformers' own modeling code (float64).

Shapes are chosen for tp 2, 3 and 4: 6 query heads over 2 KV heads (so tp 3 and 4 split heads
unevenly and replicate KV heads), intermediate sizes 10 (chunks [4, 4, 2] at tp 3: the case that
crashes DTensor TP, pytorch#150336) and a vocabulary of 101 (uneven everywhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardkit.train.model import keep_float64

VOCAB = 101
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=10,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    use_cache=False,
    tie_word_embeddings=False,
)


def build(kind: str, seed: int = 0, dtype=torch.float64, **overrides):
    """A causal LM of architecture ``kind`` (float64 by default, norms computing in float64);
    ``overrides`` replace config fields (e.g. ``num_hidden_layers``, ``tie_word_embeddings``)."""
    import transformers as tf

    COMMON = {**_COMMON, **overrides}
    if kind == "llama":
        model_cls, config = tf.LlamaForCausalLM, tf.LlamaConfig(**COMMON)
    elif kind == "qwen2":
        model_cls, config = tf.Qwen2ForCausalLM, tf.Qwen2Config(**COMMON)  # q/k/v biases
    elif kind == "qwen3":
        model_cls, config = tf.Qwen3ForCausalLM, tf.Qwen3Config(**COMMON)  # q/k norms
    elif kind == "qwen3_moe":
        model_cls = tf.Qwen3MoeForCausalLM
        config = tf.Qwen3MoeConfig(
            **COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=10,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    elif kind == "deepseek_v2":
        model_cls = tf.DeepseekV2ForCausalLM
        mla = dict(
            num_key_value_heads=6,
            q_lora_rank=None,
            kv_lora_rank=12,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=10,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
        common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
        config = tf.DeepseekV2Config(**{**common, **mla, **overrides})
    else:
        raise ValueError(kind)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # transformers' grouped_mm kernel has no float64 on CPU
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    if dtype == torch.float64:
        # the trainer's own float64 replacements (norms; DeepSeek-V2's router and rotary, per
        # instance: transformers' module and the other tests' models stay untouched)
        keep_float64(model)
    return model


def rel(a, b):
    """Relative error ``|a - b| / |b|`` (absolute when ``b`` is zero)."""
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def ids(batch=2, seq=7):
    """The same token ids on every rank: a fixed generator, not the per-test global seed."""
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))


def run(model, input_ids):
    """One HF forward with ``labels=`` and its backward; the detached logits and loss."""
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


def causal_lm_loss_f64(logits, labels, vocab_size=None, **kwargs):
    """HF's causal-LM loss without its float32 rounding of the logits (for float64 references)."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.flatten(0, -2), shifted.flatten(), ignore_index=-100)


def assert_parity(ref, model, input_ids, rtol):
    """Run both models on ``input_ids``; assert loss, logits (when both are full), every gathered
    parameter gradient and every gathered parameter equal the reference's; return the logits."""
    from shardkit.tensor_parallel import gather_full_grads, gather_full_state_dict

    ref_logits, ref_loss = run(ref, input_ids)
    logits, loss = run(model, input_ids)
    grads, state = gather_full_grads(model), gather_full_state_dict(model)
    assert rel(loss, ref_loss) <= rtol
    if logits.shape == ref_logits.shape:
        assert rel(logits, ref_logits) <= rtol
    bad = {n: rel(grads[n], p.grad) for n, p in ref.named_parameters() if rel(grads[n], p.grad) > rtol}
    assert not bad, bad
    assert all(torch.equal(state[n], p.detach()) for n, p in ref.named_parameters())
    return logits
