"""The models ``shardkit train`` trains: Hugging Face transformers' own causal LMs, from configs."""

from __future__ import annotations

import types

import torch

from .config import TrainConfig
from .data import VOCAB_SIZE

__all__ = ["TORCH_DTYPES", "build_model", "keep_norms_in_input_dtype", "keep_float64"]

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

# SDPA and eager attention both give float64 parity at rounding level (~1e-16) against the
# unsharded model on CPU (measured); SDPA is the faster of the two.
ATTN_IMPLEMENTATION = "sdpa"


def _hf_config(cfg: TrainConfig):
    """The transformers config of ``cfg.model`` at the sizes of ``cfg``."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=max(2048, cfg.seq_len),
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=max(1, cfg.intermediate_size // 2))
    head_dim = cfg.hidden_size // cfg.heads
    if cfg.model == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(**common)
    if cfg.model == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**common)
    if cfg.model == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**common, head_dim=head_dim)
    if cfg.model == "moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **common, **moe, head_dim=head_dim, num_experts=cfg.experts, norm_topk_prob=True, decoder_sparse_step=1
        )
    # "mla": DeepSeek-V2 (multi-head latent attention; the first layer dense, the others MoE).
    return tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config(
        **{**common, "num_key_value_heads": cfg.heads},
        **moe,
        q_lora_rank=None,
        kv_lora_rank=cfg.hidden_size // 2,
        qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        n_routed_experts=cfg.experts,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )


def build_model(cfg: TrainConfig):
    """``cfg.model``'s causal LM in ``cfg.dtype``, in training mode, with the full weights.

    With ``cfg.model_path`` the local checkpoint is loaded (``local_files_only``: nothing is
    downloaded); otherwise the built-in GQA config is initialized randomly from ``cfg.seed``, so
    every rank (and the ``--verify`` reference) gets bitwise the same weights.
    """
    dtype = TORCH_DTYPES[cfg.dtype]
    if cfg.model_path is not None:
        from .pretrained import load_pretrained

        model = load_pretrained(cfg.model_path, dtype)
    else:
        model_cls, config = _hf_config(cfg)
        # The loop over experts: transformers' grouped_mm kernel has no float64 on CPU.
        config._experts_implementation = "eager"
        # Initialize in float32 from the seed, then cast: the same weights for every dtype.
        torch.manual_seed(cfg.seed)
        model = model_cls(config).to(dtype)
    if dtype == torch.float64:
        keep_float64(model)
    return model.train()


def _rmsnorm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    # LlamaRMSNorm.forward's math without its float32 round trip.
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def keep_norms_in_input_dtype(model: torch.nn.Module) -> None:
    """Make the RMSNorms of a float64 model compute in float64.

    HF's RMSNorm computes in float32 whatever the input dtype (an upcast meant for half
    precision). In float64 it rounds activations to float32, so rounding-level differences
    between the parallel and the reference run (1e-16) occasionally flip a float32 rounding
    (6e-8) and grow from there: ``--verify`` measured 1e-9 parameter differences after 20 steps
    with it. Both runs get the same replacement (the reference is a copy of this model).
    """
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rmsnorm_in_input_dtype, module)


def keep_float64(model: torch.nn.Module) -> None:
    """Make a float64 model compute in float64 where transformers rounds to float32 on purpose.

    The RMSNorms (:func:`keep_norms_in_input_dtype`), and DeepSeek-V2's router and rotary
    embedding, which cast to float32 whatever the model dtype: a float64 ``--verify`` would then
    measure float32 rounding (1e-8 in the router weights after two steps) instead of the layout.
    The parallel run and its reference get the same replacements (same math, no float32 round
    trip). The attention forward looks the rotary function up among its module's globals at
    call time, so each attention of ``model`` gets its own forward, the same code over a copy of
    those globals holding the replacement: transformers' module and other models are unchanged.
    """
    keep_norms_in_input_dtype(model)
    routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV2TopkRouter"]
    if not routers:
        return
    for attention in (m for m in model.modules() if type(m).__name__ == "DeepseekV2Attention"):
        attention.forward = types.MethodType(_with_rotary_in_input_dtype(type(attention).forward), attention)
    for router in routers:
        if router.topk_method == "greedy":
            router.forward = types.MethodType(_greedy_router_in_input_dtype, router)


def _with_rotary_in_input_dtype(forward):
    """``forward`` (its undecorated function: the decorator only renames a deprecated keyword the
    decoder layer does not pass) over its globals with ``apply_rotary_emb`` replaced."""
    inner = getattr(forward, "__wrapped__", forward)
    scope = {**inner.__globals__, "apply_rotary_emb": _rotary_in_input_dtype}
    fn = types.FunctionType(inner.__code__, scope, inner.__name__, inner.__defaults__, inner.__closure__)
    fn.__kwdefaults__ = inner.__kwdefaults__
    return fn


def _rotary_in_input_dtype(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    # DeepSeek-V2's complex-number rotary embedding without its float32 cast.
    def rotate(x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(1).to(pairs.dtype)).flatten(3)

    return rotate(xq), rotate(xk)


def _greedy_router_in_input_dtype(self, hidden_states: torch.Tensor):
    # DeepseekV2TopkRouter's greedy top-k without its float32 cast.
    logits = torch.nn.functional.linear(hidden_states.view(-1, self.hidden_dim), self.weight)
    weights, indices = torch.topk(logits.softmax(dim=-1), k=self.top_k, dim=-1, sorted=False)
    return logits, weights * self.routed_scaling_factor, indices
