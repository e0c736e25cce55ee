"""``--packed`` rows without context parallelism keep a model's sliding window.

Without cp the trainer hands packed rows their block-causal mask itself
(:meth:`~shardkit.train.lm_task.LMTask.prepare`). transformers returns a ready 4-D mask as it is
for every layer kind, so a plain block-causal mask would let a sliding-window layer see its whole
document: the window silently lost, and ``--verify`` cannot see it (its reference runs the same
task). The reference here is transformers' own forward, the window applied by transformers'
mask builder, on each document alone (positions from 0): the packed row's logits must equal the
documents' logits, float64, rtol 1e-9.

Configs: Qwen2 with one full and one sliding layer (``layer_types``: the mask goes per layer
kind), Qwen3 with every layer sliding, Qwen3-MoE (no ``layer_types``: one mask function for
every layer). Documents longer than the window, so the window hides keys; coordinate-encoded ids
(token ``t`` of document ``d`` is ``(7 d + 3 t) % V``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shardkit.parallelize import DecoderStageModule
from shardkit.train.lm_task import LMTask, Microbatch

WINDOW, S, V = 3, 12, 40
CUS = [(0, 7, 12), (0, 2, 12)]  # two rows: documents of 7 + 5 and 2 + 10 tokens


def _model(kind: str, window: bool = True):
    import transformers

    common = dict(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=window,
        sliding_window=WINDOW,
        tie_word_embeddings=False,
    )
    if kind == "qwen2 (full + sliding)":
        config = transformers.Qwen2Config(max_window_layers=1, **common)
        assert config.layer_types == ["full_attention", "sliding_attention"]
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3 (every layer sliding)":
        config = transformers.Qwen3Config(max_window_layers=0, head_dim=8, **common)
        assert config.layer_types == ["sliding_attention" if window else "full_attention"] * 2
        cls = transformers.Qwen3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(
            head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, **common
        )
        config._experts_implementation = "eager"
        assert config.sliding_window == WINDOW
        cls = transformers.Qwen3MoeForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(config).double().eval()


def _ids() -> torch.Tensor:
    ids = torch.zeros(len(CUS), S, dtype=torch.long)
    for r, cu in enumerate(CUS):
        for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            ids[r, a:b] = (7 * (2 * r + d) + 3 * torch.arange(b - a)) % V
    return ids


@pytest.mark.parametrize("kind", ["qwen2 (full + sliding)", "qwen3 (every layer sliding)", "qwen3-moe (one window)"])
def test_packed_rows_keep_the_sliding_window(kind):
    model = _model(kind)
    ids = _ids()
    task = LMTask(sampler=None, device=torch.device("cpu"))
    inputs, _ = task.prepare(Microbatch(ids, [list(cu) for cu in CUS]), SimpleNamespace(cp=None, module=model))
    with torch.no_grad():
        packed = model(**inputs).logits
        for r, cu in enumerate(CUS):
            for a, b in zip(cu[:-1], cu[1:]):
                alone = model(input_ids=ids[r : r + 1, a:b]).logits[0]  # transformers' own window
                torch.testing.assert_close(packed[r, a:b], alone, rtol=1e-9, atol=1e-12)


def test_the_window_hides_keys_here():
    """The check above can fail: without the window (same weights) the 7-token document's logits
    differ after the first ``WINDOW`` tokens, and agree before."""
    ids = _ids()[:1, :7]
    with torch.no_grad():
        windowed = _model("qwen3 (every layer sliding)")(input_ids=ids).logits
        full = _model("qwen3 (every layer sliding)", window=False)(input_ids=ids).logits
    assert not torch.allclose(windowed[0, WINDOW:], full[0, WINDOW:], rtol=1e-6)
    torch.testing.assert_close(windowed[0, :WINDOW], full[0, :WINDOW], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["qwen2 (full + sliding)", "qwen3-moe (one window)"])
def test_pipeline_stages_take_the_packed_masks(kind):
    """Pipeline stages (two stages, run in turn in one process) get the same masks from
    :meth:`LMTask.prepare` (the per-kind mapping for Qwen2) and give the packed logits of the
    whole model, which the test above ties to transformers' documents."""
    model = _model(kind)
    ids = _ids()
    stages = [DecoderStageModule(model, s, 2) for s in range(2)]
    task = LMTask(sampler=None, device=torch.device("cpu"))
    mb = Microbatch(ids, [list(cu) for cu in CUS])
    inputs, _ = task.prepare(mb, SimpleNamespace(cp=None, module=stages[0]))
    with torch.no_grad():
        want = model(**task.prepare(mb, SimpleNamespace(cp=None, module=model))[0]).logits
        h = inputs.pop("input_ids")
        for stage in stages:
            h = stage(h, **inputs)
    torch.testing.assert_close(h, want, rtol=1e-9, atol=1e-12)
