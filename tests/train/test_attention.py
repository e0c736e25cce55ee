"""The trainer's mask-free SDPA (shardkit.train.attention): bitwise the logits of transformers'
"sdpa", plain and packed, without a device read in the forward (issue 29)."""

import pytest
import torch
import transformers

from shardkit.comm.host_sync import HostSyncCounter
from shardkit.train.attention import NAME, mask_free_sdpa, packed_causal_mask
from shardkit.train.lm_task import _positions

S = 16
CUS = [(0, 5, 11, 16), (0, 16), (0, 1, 16)]


def _model(kind: str, **extra):
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        attn_implementation="sdpa",
        **extra,
    )
    torch.manual_seed(0)
    return model_class(config).to(torch.float64).eval()


def _reads(model, **inputs) -> tuple[torch.Tensor, int]:
    counter = HostSyncCounter("cpu")
    with counter, torch.no_grad():
        logits = model(**inputs).logits
    return logits, counter.totals(counter.next_step())[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_mask_free_sdpa_is_bitwise_sdpa(kind):
    model = _model(kind)
    ids = torch.randint(0, 64, (len(CUS), S), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([_positions(cu, S) for cu in CUS])
    plain, plain_reads = _reads(model, input_ids=ids)
    packed, packed_reads = _reads(model, input_ids=ids, position_ids=positions)
    assert plain_reads == 1 and packed_reads == 1  # transformers' probe of position_ids
    assert mask_free_sdpa(model) and model.config._attn_implementation == NAME
    out, reads = _reads(model, input_ids=ids)
    assert reads == 0 and torch.equal(out, plain)
    mask = packed_causal_mask(CUS, S, "cpu")
    out, reads = _reads(model, input_ids=ids, position_ids=positions, attention_mask=mask)
    assert reads == 0 and torch.equal(out, packed)
    assert not torch.equal(packed, plain)  # the documents are kept apart


def test_packed_causal_mask():
    mask = packed_causal_mask([(0, 2, 4), (0, 4)], 4, "cpu")
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    blocks = torch.block_diag(torch.ones(2, 2), torch.ones(2, 2)).bool()
    assert torch.equal(mask[0, 0], causal & blocks) and torch.equal(mask[1, 0], causal)


def test_sliding_window_keeps_sdpa():
    model = _model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert not mask_free_sdpa(model) and model.config._attn_implementation == "sdpa"
    eager = _model("llama")
    eager.set_attn_implementation("eager")
    assert not mask_free_sdpa(eager) and eager.config._attn_implementation == "eager"
