"""The built-in configs of the decoder LMs ``shardkit train`` builds from flags (no ``--model-path``).

One :class:`LMFamily` per Hugging Face architecture: the transformers classes and the config at
the sizes of the flags. :func:`.model.build_model` builds the model from it and
:func:`.limits.builtin_shape` reads the same dict for the planner's memory estimate, so the two
cannot drift. The spec registry (:mod:`.specs`) names which ``--model`` uses which family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .data import VOCAB_SIZE
from .options import TrainConfig
from .pretrained import attn_implementation, tokenizer_vocab

__all__ = ["LMFamily", "LLAMA", "QWEN2", "QWEN3", "QWEN3_MOE", "DEEPSEEK_V2", "GEMMA2"]


@dataclass(frozen=True)
class LMFamily:
    """One Hugging Face decoder architecture.

    Attributes:
        model_type: the config's ``model_type`` (what ``--model-path`` checkpoints name).
        model_class: the transformers model class name (looked up when building).
        config_class: the transformers config class name (looked up when building).
        experts: a mixture-of-experts architecture (``--ep``, ``--experts``).
        extras: the family's config keys beyond the common ones, from the flags.
    """

    model_type: str
    model_class: str
    config_class: str
    experts: bool
    extras: Callable[[TrainConfig], dict]

    def config(self, cfg: TrainConfig) -> dict:
        """The transformers config kwargs of this family at ``cfg``'s sizes (``model_type`` included)."""
        common = dict(
            model_type=self.model_type,
            vocab_size=VOCAB_SIZE if cfg.tokenizer is None else tokenizer_vocab(cfg.tokenizer),
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            max_position_embeddings=max(2048, cfg.seq_len),
            use_cache=False,
            tie_word_embeddings=False,
            attn_implementation=attn_implementation(self.model_type),
        )
        return {**common, **self.extras(cfg)}


def _head_dim(cfg: TrainConfig) -> int:
    return cfg.hidden_size // cfg.heads


def _moe(cfg: TrainConfig) -> dict:
    return dict(num_experts_per_tok=2, moe_intermediate_size=max(1, cfg.intermediate_size // 2))


def _qwen3_moe(cfg: TrainConfig) -> dict:
    return dict(
        **_moe(cfg),
        head_dim=_head_dim(cfg),
        num_experts=cfg.experts,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    )


def _deepseek_v2(cfg: TrainConfig) -> dict:
    # multi-head latent attention (one KV head per query head); the first layer dense, the others
    # MoE; head_dim is the rotary part, as DeepseekV2Config derives it
    head_dim = _head_dim(cfg)
    return dict(
        **_moe(cfg),
        num_key_value_heads=cfg.heads,
        q_lora_rank=None,
        head_dim=head_dim // 2,
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


def _gemma2(cfg: TrainConfig) -> dict:
    # Gemma 2's own traits at the flags' sizes: a sliding window on the even layers (layer_types'
    # default) shorter than --seq-len so it hides keys, the attention and final logit softcaps,
    # query_pre_attn_scalar (its scale, 1 / sqrt of it, differs from 1 / sqrt(head_dim) on purpose
    # so a layout that drops it fails --verify), sandwich norms and tied embeddings (the class's)
    head_dim = _head_dim(cfg)
    return dict(
        head_dim=head_dim,
        sliding_window=max(1, cfg.seq_len // 2),
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=2 * head_dim,
        tie_word_embeddings=True,
    )


LLAMA = LMFamily("llama", "LlamaForCausalLM", "LlamaConfig", False, lambda cfg: {})
QWEN2 = LMFamily("qwen2", "Qwen2ForCausalLM", "Qwen2Config", False, lambda cfg: {})
QWEN3 = LMFamily("qwen3", "Qwen3ForCausalLM", "Qwen3Config", False, lambda cfg: dict(head_dim=_head_dim(cfg)))
QWEN3_MOE = LMFamily("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", True, _qwen3_moe)
DEEPSEEK_V2 = LMFamily("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config", True, _deepseek_v2)
GEMMA2 = LMFamily("gemma2", "Gemma2ForCausalLM", "Gemma2Config", False, _gemma2)
