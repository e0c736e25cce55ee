"""apply_cp on Hugging Face models whose configs carry attention variants, against the unsharded model.

Qwen2 and Qwen3 with ``sliding_window`` on their ``sliding_attention`` layers (``layer_types``), and
Gemma 2 with both a sliding window and ``attn_logit_softcapping``. The reference is transformers' own
attention on the full sequence (SDPA with transformers' sliding-window mask for Qwen, eager for Gemma 2,
which has no SDPA path for a softcap): so the window's convention (keys ``i - W < j <= i``) and the
cap's place (before the mask) are checked against transformers itself. float64, logits gathered back
to global order, the loss and every parameter gradient summed over the cp ranks, to rtol 1e-9.
"""

import types

import pytest
import torch

from harness.helpers import get_mesh, rank, world_group
from shardkit.context_parallel.apply import apply_cp
from shardkit.train.lm_task import causal_lm_loss
from shardkit.train.model import keep_norms_in_input_dtype

RTOL = 1e-9
WALL = 300  # the first test of a world imports transformers on every rank
WINDOW = 5  # shorter than every test's S: the window hides keys


def _gemma_norm_in_input_dtype(self, x):
    # Gemma 2's RMSNorm computes in float32 (x.float()); in float64 that rounding, not the layout,
    # would set the error (see keep_norms_in_input_dtype). Same formula, input dtype.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _eager_in_input_dtype(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **_):
    """Gemma 2's eager attention with its softmax in the input dtype (transformers' rounds the
    weights to float32): the same order of operations (scale, cap, add the mask, softmax)."""
    rep = module.num_key_value_groups
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _model(family, attn, window=WINDOW, softcap=0.5):
    import transformers

    common = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=45,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    if family == "llama":  # no variant: the plain layouts of ring_layout=
        config = transformers.LlamaConfig(**common)
    elif family == "qwen2":  # layer 1 slides (max_window_layers = 1)
        config = transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=window, max_window_layers=1)
    elif family == "qwen3":
        config = transformers.Qwen3Config(
            **common,
            use_sliding_window=True,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"],
        )
    else:  # a cap that bites at these score sizes (Gemma 2 ships 50.0)
        config = transformers.Gemma2Config(
            **common, sliding_window=window, attn_logit_softcapping=softcap, query_pre_attn_scalar=8
        )
    torch.manual_seed(0)
    model = getattr(transformers, f"{type(config).__name__[:-6]}ForCausalLM")(config).double()
    keep_norms_in_input_dtype(model)
    for m in model.modules():
        if type(m).__name__ == "Gemma2RMSNorm":
            m.forward = types.MethodType(_gemma_norm_in_input_dtype, m)
    return model


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item() if b.norm() > 0 else (a - b).norm().item()


def _check(family, mode, mesh, seq, ring_layout="zigzag", cu=None):
    import transformers.models.gemma2.modeling_gemma2 as gemma2

    saved, gemma2.eager_attention_forward = gemma2.eager_attention_forward, _eager_in_input_dtype  # on this rank
    try:
        return _compare(family, mode, mesh, seq, ring_layout, cu)
    finally:
        gemma2.eager_attention_forward = saved


def _compare(family, mode, mesh, seq, ring_layout, cu):
    ids = torch.randint(0, 101, (2, seq), generator=torch.Generator().manual_seed(seq))
    ref = _model(family, "eager" if family == "gemma2" else "sdpa")
    variants = family != "llama"
    assert not variants or any(getattr(layer.self_attn, "sliding_window", None) == WINDOW for layer in ref.model.layers)
    if cu is None:
        ref_logits = ref(input_ids=ids).logits
        ref_loss = causal_lm_loss(ref_logits, ids)
    else:  # every document on its own, one token-mean loss
        docs = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]
        ref_logits = torch.cat([ref(input_ids=ids[:, a:b]).logits for a, b in docs], dim=1)
        ce = torch.nn.functional.cross_entropy
        total = sum(
            ce(ref_logits[:, a : b - 1].flatten(0, 1), ids[:, a + 1 : b].flatten(), reduction="sum") for a, b in docs
        )
        ref_loss = total / sum(ids.shape[0] * (b - a - 1) for a, b in docs)
    ref_loss.backward()

    model = _model(family, "sdpa" if family != "gemma2" else "eager")
    ctx = apply_cp(model, mesh, mode, ring_layout=ring_layout)
    b = ctx.shard_batch(ids, ids, cu_seqlens=cu)
    logits = model(**b.inputs).logits
    loss = ctx.loss(logits, b.labels, b.num_tokens)
    loss.backward()
    ctx.all_reduce_grads(model)
    err = _rel(ctx.gather(logits.detach(), b), ref_logits.detach())
    assert err <= RTOL, err
    assert abs(loss.item() - ref_loss.item()) <= RTOL * abs(ref_loss.item())
    grads = dict(model.named_parameters())
    errors = {n: _rel(grads[n].grad, p.grad) for n, p in ref.named_parameters()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= RTOL, (worst, errors[worst])
    if not variants:
        return b
    # the variants bite: the same weights without them (a window wider than S, no cap) differ
    plain = _model(family, "eager", window=64, softcap=None)(input_ids=ids).logits.detach()
    assert _rel(plain, ref_logits.detach()) > 1e-6
    return b


@pytest.mark.world(2, timeout=WALL)
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma2"])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_variants_r2(family, mode):
    _check(family, mode, world_group(), 13)


@pytest.mark.world(4, timeout=WALL)
@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_variants_usp_2x2(family):
    _check(family, "usp", get_mesh((2, 2), ("cp_ring", "cp_ulysses")), 19)


@pytest.mark.world(2, timeout=WALL)
@pytest.mark.parametrize(
    "family,ring_layout,cu",
    [("qwen2", "contiguous", None), ("qwen2", "contiguous", (0, 6, 13)), ("llama", "stripe", None)],
)
def test_ring_layouts(family, ring_layout, cu):
    """apply_cp(..., ring_layout=): Llama 3's contiguous slice (with a sliding window, and with
    packed documents) and the stripe layout, against the unsharded model."""
    b = _check(family, "ring", world_group(), 13, ring_layout, cu)
    r = rank()
    expected = list(range(r, 13, 2)) if ring_layout == "stripe" else list(range(7 * r, 7 + 6 * r))
    assert b.indices.tolist() == expected  # the layout asked for, not zigzag
