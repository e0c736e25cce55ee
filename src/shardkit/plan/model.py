"""Model accounting for the planner: the shape of a Hugging Face decoder config, its parameters
(full and per rank of a layout) and its training FLOPs.

Families: those ``shardkit train`` composes (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2/V3 with
multi-head latent attention). Parameter names and shapes follow transformers' modeling code, so
the per-rank counts equal the ``numel`` of the real model after :func:`shardkit.parallelize`
(checked by ``tests/plan``).

Source: the parameter and FLOP accounting of Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (2021), appendix (6 x params x tokens plus
attention); the DeepSeek-V2 paper for MLA shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ModelShape"]

_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
}


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder LM that set its parameters, FLOPs and collectives.

    Attributes:
        family: ``llama``, ``qwen2`` (q/k/v biases), ``qwen3`` (q/k norms), ``qwen3_moe`` or
            ``deepseek`` (multi-head latent attention, shared experts).
        vocab: V. hidden: H. layers: L. heads: N query heads. kv_heads: key/value heads.
        head_dim: D. ffn: dense MLP width F.
        tied: input and output embeddings share one weight.
        experts: routed experts E (0: dense). top_k: experts per token. moe_ffn: one expert's width.
        shared_experts: always-on experts (DeepSeek) of width ``moe_ffn``.
        dense_layers: indices of the layers with a dense MLP in an MoE model.
        q_lora_rank: MLA's query LoRA rank (0: a plain ``q_proj``).
        kv_lora_rank: MLA's key/value LoRA rank (0 for ordinary attention).
        qk_rope_dim: MLA's rotary part of each query/key head.
        qk_nope_dim: MLA's non-rotary part of each query/key head.
        v_head_dim: MLA's value head dim.
    """

    family: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: tuple[int, ...] = ()
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read a transformers ``PretrainedConfig``, a ``config.json`` dict, or a path to one.

        Raises:
            ShardkitError: unreadable file, unsupported ``model_type`` or a missing/invalid size
                (the message names the field).
        """
        if isinstance(config, (str, Path)):
            try:
                config = json.loads(Path(config).read_text())
            except (OSError, ValueError) as e:
                raise ShardkitError(f"plan: cannot read the config {config}: {e}") from e
        model_type = _get(config, "model_type")
        if model_type not in _FAMILIES:
            raise ShardkitError(f"plan: model_type {model_type!r} is not supported; supported: {sorted(_FAMILIES)}")
        family = _FAMILIES[model_type]

        def need(name: str) -> int:
            value = _get(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ShardkitError(f"plan: config field {name} must be an int >= 1 for {model_type}, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kv = _get(config, "num_key_value_heads") or heads
        head_dim = _get(config, "head_dim") or hidden // heads
        if heads % kv:
            raise ShardkitError(f"plan: num_attention_heads={heads} must be a multiple of num_key_value_heads={kv}")
        layers = need("num_hidden_layers")
        fields: dict[str, Any] = dict(
            family=family,
            vocab=need("vocab_size"),
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            ffn=need("intermediate_size"),
            tied=bool(_get(config, "tie_word_embeddings", False)),
        )
        if family == "qwen3_moe":
            sparse = _get(config, "decoder_sparse_step", 1) or 1
            only = set(_get(config, "mlp_only_layers", None) or ())
            dense = tuple(i for i in range(layers) if i in only or (i + 1) % sparse)
            fields.update(
                experts=need("num_experts"),
                top_k=need("num_experts_per_tok"),
                moe_ffn=need("moe_intermediate_size"),
                dense_layers=dense,
            )
        if family == "deepseek":
            first = _get(config, "first_k_dense_replace", 0) or 0
            fields.update(
                experts=need("n_routed_experts"),
                top_k=need("num_experts_per_tok"),
                moe_ffn=need("moe_intermediate_size"),
                shared_experts=_get(config, "n_shared_experts", 0) or 0,
                dense_layers=tuple(range(min(first, layers))),
                q_lora_rank=_get(config, "q_lora_rank") or 0,
                kv_lora_rank=need("kv_lora_rank"),
                qk_rope_dim=need("qk_rope_head_dim"),
                qk_nope_dim=need("qk_nope_head_dim"),
                v_head_dim=need("v_head_dim"),
                kv_heads=heads,
            )
        return cls(**fields)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def qk_dim(self) -> int:
        """Head dim of queries and keys (MLA: the non-rotary and rotary parts together)."""
        return self.qk_nope_dim + self.qk_rope_dim if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        """Head dim of values and of the attention output."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts."""
        return 0 if not self.experts else self.layers - len(self.dense_layers)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` has routed experts."""
        return self.experts > 0 and index not in self.dense_layers

    def attention_params(self, tp: int = 1) -> int:
        """Parameters of one attention block on one of ``tp`` ranks (whole heads per rank)."""
        H, N, D = self.hidden, self.heads, self.head_dim
        n = N // tp
        if self.mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            q = (
                (H * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk)
                if self.q_lora_rank
                else H * n * qk
            )
            kv_a = H * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank  # replicated, with its norm
            kv_b = self.kv_lora_rank * n * (self.qk_nope_dim + self.v_head_dim)
            return q + kv_a + kv_b + n * self.v_head_dim * H
        kv = max(1, self.kv_heads // tp)  # fewer kv heads than ranks: one (replicated) head each
        out = H * n * D + 2 * H * kv * D + n * D * H
        if self.family == "qwen2":
            out += n * D + 2 * kv * D  # q/k/v biases
        if self.family in ("qwen3", "qwen3_moe"):
            out += 2 * D  # q_norm, k_norm (replicated)
        return out

    def mlp_params(self, index: int, tp: int = 1, ep: int = 1) -> tuple[int, int]:
        """``(dense, expert)`` parameters of layer ``index``'s MLP on one rank: dense MLP or router
        and shared experts cut over ``tp``; routed experts cut over ``ep`` (``ep`` 1: over ``tp``)."""
        H = self.hidden
        if not self.is_moe_layer(index):
            return 3 * H * (self.ffn // tp), 0
        shared = 3 * H * (self.moe_ffn * self.shared_experts // tp)
        per_expert = 3 * H * self.moe_ffn
        experts = self.experts // ep * per_expert if ep > 1 else self.experts * per_expert // tp
        return self.experts * H + shared, experts

    def layer_params(self, index: int, tp: int = 1, ep: int = 1) -> tuple[int, int]:
        """``(dense, expert)`` parameters of decoder layer ``index`` on one rank (norms included)."""
        dense, expert = self.mlp_params(index, tp, ep)
        return self.attention_params(tp) + dense + 2 * self.hidden, expert

    def stage_layers(self, pp: int, stage: int) -> range:
        """The layers of pipeline stage ``stage`` of ``pp`` (balanced, the first ``L % pp`` one more)."""
        base, extra = divmod(self.layers, pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def rank_params(
        self,
        tp: int = 1,
        ep: int = 1,
        pp: int = 1,
        stage: int = 0,
        *,
        part: tuple[Sequence[int], bool, bool] | None = None,
    ) -> tuple[int, int]:
        """``(dense, expert)`` parameters held by one rank of pipeline stage ``stage`` before FSDP2.

        The embedding (vocab-parallel rows) sits on the first stage; the final norm and
        ``lm_head`` (vocab-parallel columns) on the last; a tied head on the stage of the
        embedding is one weight. ``part``: the rank's ``(layers, holds the embedding, holds the
        head)`` where they are not the stage's (virtual stages,
        :func:`~shardkit.plan.options.stage_part`).
        """
        layers, first, last = part if part is not None else (self.stage_layers(pp, stage), stage == 0, stage == pp - 1)
        dense = expert = 0
        for i in layers:
            d, e = self.layer_params(i, tp, ep)
            dense, expert = dense + d, expert + e
        table = self.vocab // tp * self.hidden
        if first:
            dense += table
        if last:
            dense += self.hidden + (0 if self.tied and first else table)
        return dense, expert

    @property
    def total_params(self) -> int:
        """Every parameter of the model (one copy)."""
        return sum(self.rank_params())

    @property
    def active_params(self) -> int:
        """Parameters a token passes through in the matmuls (routed experts: ``top_k`` of them),
        without the embedding lookup and the norms: the ``N`` of ``6 N`` FLOPs per token."""
        H, total = self.hidden, 0
        for i in range(self.layers):
            total += self.attention_params() - (2 * self.head_dim if self.family in ("qwen3", "qwen3_moe") else 0)
            dense, _ = self.mlp_params(i)
            total += dense + (3 * H * self.moe_ffn * self.top_k if self.is_moe_layer(i) else 0)
        return total + self.vocab * H

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 N`` for the matmuls plus causal attention
        ``6 L S (d_qk + d_v) N / 2`` (scores and values, forward and backward, half the square)."""
        return 6.0 * self.active_params + 3.0 * self.layers * seq_len * self.heads * (self.qk_dim + self.v_dim)
