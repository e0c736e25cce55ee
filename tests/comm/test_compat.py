"""The version shim (``shardkit.comm._compat``): what it gives on every supported release.

The older releases' paths are checked here on whatever torch / transformers is installed, by
pinning the release the shim believes it runs on; ``scripts/check_floors.sh`` runs the suite on
the real floors and the newest releases.
"""

import pytest
import torch
import torch.nn.functional as F

from shardkit.comm import _compat


def test_release_parses_local_versions():
    assert _compat.release("2.11.0+cu130") == (2, 11)
    assert _compat.release("5.17.0") == (5, 17)
    assert _compat.release(torch.__version__) == _compat.TORCH_RELEASE
    with pytest.raises(ValueError):
        _compat.release("nightly")


@pytest.mark.parametrize("crashes", [False, True])
@pytest.mark.parametrize("shape", [(2, 0, 3, 4), (0, 2, 3, 4), (2, 2, 0, 4)])
def test_sdpa_on_empty_inputs(monkeypatch, crashes, shape):
    """A rank of a Ulysses group with no heads (or no tokens) gets an empty output and empty
    gradients, by the kernel (torch >= 2.13) or by the shim's matmuls (the path of older torch,
    whose CPU kernel dies with SIGFPE on zero heads)."""
    if not crashes and shape[1] == 0 and _compat.TORCH_RELEASE < (2, 13):
        pytest.skip("torch < 2.13's own kernel dies on zero heads (the reason for the shim)")
    monkeypatch.setattr(_compat, "_SDPA_EMPTY_CRASHES", crashes)
    q, k, v = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = _compat.sdpa(q, k, v, is_causal=True)
    assert out.shape == shape and out.dtype == q.dtype
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == shape for t in (q, k, v))


def test_sdpa_on_nonempty_inputs_is_torchs():
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=torch.float64) for _ in range(3))
    assert torch.equal(_compat.sdpa(q, k, v, is_causal=True), F.scaled_dot_product_attention(q, k, v, is_causal=True))


_EARLIER_EP = {
    "layers.*.mlp.gate": "ep_router",
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "moe_tp_experts",
}
_DISPATCH_EP = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}


class _Config:
    def __init__(self, ep):
        self.base_model_ep_plan = ep


@pytest.mark.parametrize("hf", [(5, 17), (5, 18)])
def test_the_earlier_ep_plan_reads_as_dispatch(monkeypatch, hf):
    monkeypatch.setattr(_compat, "transformers_release", lambda: hf)
    assert _compat.hf_ep_plan(_Config(_EARLIER_EP)) == _DISPATCH_EP
    assert _compat.hf_ep_plan(_Config(_DISPATCH_EP)) == _DISPATCH_EP
    mixed = {"layers.*.mlp.gate": "ep_router", **_DISPATCH_EP}  # a plan someone wrote: kept
    assert _compat.hf_ep_plan(_Config(mixed)) == mixed
    assert _compat.hf_ep_plan(_Config(None)) is None and _compat.hf_ep_plan(None) is None


def test_ep_plans_of_newer_releases_are_kept(monkeypatch):
    monkeypatch.setattr(_compat, "transformers_release", lambda: (5, 19))
    assert _compat.hf_ep_plan(_Config(_EARLIER_EP)) == _EARLIER_EP  # a plan someone chose: left alone
    ep = _Config(_DISPATCH_EP)
    assert _compat.hf_ep_plan(ep) == _DISPATCH_EP and _compat.hf_ep_plan(ep) is not ep.base_model_ep_plan


def _llama():
    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    return tf.LlamaForCausalLM(config)


def _without_embedding_rule(model):
    """The model's plans as transformers < 5.21 builds them (no embed_tokens rule)."""
    model.model._tp_plan = {k: v for k, v in model.model._tp_plan.items() if k != "embed_tokens"}
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if k != "model.embed_tokens"}


def test_the_embedding_rule_is_added_as_transformers_5_21_does(monkeypatch):
    """On a release before 5.21 the plan gets ``model.embed_tokens: embedding_rowwise`` where 5.21
    puts it (first among the base model's rules); from 5.21 the model's own plan is returned."""
    model = _llama()
    expected = [
        ("lm_head", "colwise_gather_output"),
        ("model.embed_tokens", "embedding_rowwise"),
        ("model.layers.*.self_attn.q_proj", "colwise"),
    ]
    if _compat.transformers_release() >= (5, 21):
        assert list(_compat.hf_tp_plan(model).items())[:3] == expected
        _without_embedding_rule(model)
    monkeypatch.setattr(_compat, "transformers_release", lambda: (5, 17))
    plan = _compat.hf_tp_plan(model)
    assert list(plan.items())[:3] == expected
    assert plan == {**dict(expected[:2]), **model.tp_plan}
    base = _compat.hf_tp_plan(model.model)  # the base model alone: its own plan, unprefixed
    assert list(base.items())[0] == ("embed_tokens", "embedding_rowwise")


def test_a_plan_naming_the_embedding_is_kept(monkeypatch):
    model = _llama()
    _without_embedding_rule(model)
    model.model._tp_plan = {"embed_tokens": "embedding_colwise", **model.model._tp_plan}
    model._tp_plan = {"model.embed_tokens": "embedding_colwise", **model._tp_plan}
    monkeypatch.setattr(_compat, "transformers_release", lambda: (5, 17))
    assert _compat.hf_tp_plan(model)["model.embed_tokens"] == "embedding_colwise"
