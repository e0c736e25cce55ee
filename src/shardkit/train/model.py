"""The models ``shardkit train`` trains: Hugging Face transformers' own causal LMs, from configs."""

from __future__ import annotations

import types
from typing import Any

import torch

from .lm_families import LMFamily
from .options import TrainConfig
from .pretrained import load_pretrained

__all__ = ["hf_config", "build_model", "keep_norms_in_input_dtype", "keep_float64"]


def hf_config(cfg: TrainConfig, family: LMFamily) -> tuple[type, Any]:
    """``(model class, config)``: ``family``'s transformers classes, the config at ``cfg``'s sizes
    (:meth:`.lm_families.LMFamily.config`)."""
    import transformers  # kept out of `shardkit --help` and of the conv model's runs

    kwargs = family.config(cfg)
    del kwargs["model_type"]  # the config class's own
    return getattr(transformers, family.model_class), getattr(transformers, family.config_class)(**kwargs)


def build_model(cfg: TrainConfig, family: LMFamily):
    """``cfg.model``'s causal LM in ``cfg.dtype``, in training mode, with the full weights.

    With ``cfg.model_path`` the local checkpoint is loaded (``local_files_only``: nothing is
    downloaded); otherwise ``family``'s built-in config at the flags' sizes is initialized
    randomly from ``cfg.seed``, so every rank (and the ``--verify`` reference) gets bitwise the
    same weights.
    """
    dtype = getattr(torch, cfg.dtype)  # a name of options.DTYPES
    if cfg.model_path is not None:
        model = load_pretrained(cfg.model_path, dtype)
    else:
        model_cls, config = hf_config(cfg, family)
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

    The RMSNorms (:func:`keep_norms_in_input_dtype`; Gemma 2's own too), Gemma 2's eager
    attention's softmax, and DeepSeek-V2's router and rotary embedding, which cast to float32
    whatever the model dtype: a float64 ``--verify`` would then
    measure float32 rounding (1e-8 in the router weights after two steps) instead of the layout.
    The parallel run and its reference get the same replacements (same math, no float32 round
    trip). The attention forward looks the rotary function up among its module's globals at
    call time, so each attention of ``model`` gets its own forward, the same code over a copy of
    those globals holding the replacement: transformers' module and other models are unchanged.
    """
    keep_norms_in_input_dtype(model)
    _keep_gemma2_float64(model)
    routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV2TopkRouter"]
    if not routers:
        return
    for attention in (m for m in model.modules() if type(m).__name__ == "DeepseekV2Attention"):
        attention.forward = types.MethodType(_with_rotary_in_input_dtype(type(attention).forward), attention)
    for router in routers:
        if router.topk_method == "greedy":
            router.forward = types.MethodType(_greedy_router_in_input_dtype, router)


def _keep_gemma2_float64(model: torch.nn.Module) -> None:
    """Gemma 2's RMSNorm (``x.float()`` first) and eager attention (softmax in float32) without
    their float32 round trips: the same formulas in the input dtype. The eager attention is
    what a layout without cp runs, the ``--verify`` reference included."""
    for module in model.modules():
        name = type(module).__name__
        if name == "Gemma2RMSNorm":
            module.forward = types.MethodType(_gemma2_norm_in_input_dtype, module)
        elif name == "Gemma2Attention":
            forward = _with_globals(type(module).forward, eager_attention_forward=_eager_in_input_dtype)
            module.forward = types.MethodType(forward, module)


def _gemma2_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    # Gemma2RMSNorm.forward's math (a 1-centred weight) without its float32 round trip.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _eager_in_input_dtype(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **_):
    """Gemma 2's eager attention with its softmax in the input dtype: the same order (scale, cap,
    add the additive mask, softmax, dropout); ``query`` ``[B, N, S, D]``, ``key`` / ``value``
    ``[B, N_kv, S, D]``; returns ``([B, S, N, D], weights)`` as transformers' does."""
    rep = module.num_key_value_groups
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scores = query @ key.transpose(2, 3) * (module.head_dim**-0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _with_rotary_in_input_dtype(forward):
    """``forward`` over its globals with ``apply_rotary_emb`` replaced (:func:`_with_globals`)."""
    return _with_globals(forward, apply_rotary_emb=_rotary_in_input_dtype)


def _with_globals(forward, **replaced):
    """``forward`` (its undecorated function: the decorator only renames a deprecated keyword the
    decoder layer does not pass) over a copy of its globals with ``replaced`` names."""
    inner = getattr(forward, "__wrapped__", forward)
    scope = {**inner.__globals__, **replaced}
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
