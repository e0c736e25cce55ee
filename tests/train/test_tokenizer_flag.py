"""``shardkit train --tokenizer`` (issue 23, item 5): a Hugging Face tokenizer directory encodes
``--data`` for a model built from flags, whose vocabulary becomes ``len(tokenizer)``; the export
writes that tokenizer. Bad combinations fail before launch with one ShardkitError.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from harness.pretrained import save_tokenizer
from shardkit import ShardkitError, export_hf
from shardkit.cli.main import main
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, validate_config
from shardkit.train.pretrained import TOKENIZER_FILES, load_text_tokenizer, tokenizer_vocab
from shardkit.train.run import train
from shardkit.train.tokens import _cache_key

BASE = dict(seq_len=16, batch_size=4, dtype="float32", layers=2, lr=1e-2, steps=2)
DATA = str(Path(json.__file__))


@pytest.mark.world(2, timeout=240)
def test_tp2_run_with_a_tokenizer_dir_builds_its_vocab_verifies_and_exports_it():
    from transformers import AutoTokenizer

    root = shared_tmpdir("shardkit-tokenizer-")
    try:
        tok, ckpt, out = (os.path.join(root, n) for n in ("tok", "ckpt", "hf"))
        if rank() == 0:
            save_tokenizer(Path(tok))
        torch.distributed.barrier()
        cfg = validate_config(
            TrainConfig(**BASE, tokenizer=tok, data=DATA, tp=2, verify=True, checkpoint_dir=ckpt),
            world_size=world_size(),
        )
        check_checkpoint_dir(cfg)
        train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        if rank() == 0:
            export_hf(ckpt, out, step=2)
            vocab = len(AutoTokenizer.from_pretrained(tok))
            assert vocab != 256 and tokenizer_vocab(tok) == vocab
            assert json.loads(Path(out, "config.json").read_text())["vocab_size"] == vocab
            text = "def load(fp):\n    return loads(fp.read())"
            assert (
                AutoTokenizer.from_pretrained(out)(text).input_ids == AutoTokenizer.from_pretrained(tok)(text).input_ids
            )
            assert not Path(out, "README.md").exists()  # the byte-level note is for runs without a tokenizer
    finally:
        remove_shared_dir(root)


def test_tokenizer_is_refused_with_model_path_and_for_conv_ae(tmp_path):
    tok = str(save_tokenizer(tmp_path / "tok"))
    with pytest.raises(ShardkitError, match="--tokenizer with --model-path"):
        validate_config(TrainConfig(**BASE, tokenizer=tok, model_path=str(tmp_path)), world_size=1)
    with pytest.raises(ShardkitError, match="--tokenizer with --model conv-ae"):
        validate_config(TrainConfig(model="conv-ae", tokenizer=tok), world_size=1)
    with pytest.raises(ShardkitError, match="--packed with --tokenizer"):
        validate_config(TrainConfig(**BASE, tokenizer=tok, packed=True, tp=1), world_size=1)


def test_a_dir_without_tokenizer_files_fails_before_launch_naming_them(tmp_path, capsys, monkeypatch):
    import shardkit.cli.launch as cli_launch

    monkeypatch.setattr(cli_launch, "launch_local", lambda *a, **k: pytest.fail("launched"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardkitError, match="has no tokenizer") as e:
        load_text_tokenizer(tmp_path / "empty", "--tokenizer")
    assert all(name in str(e.value) for name in TOKENIZER_FILES)
    argv = ["train", "--tokenizer", str(tmp_path / "empty"), "--data", DATA, "--steps", "1", "--seq-len", "16"]
    assert main(argv) == 2
    assert "--tokenizer" in capsys.readouterr().err and "tokenizer.json" in str(e.value)


def test_the_token_cache_key_of_a_tokenizer_dir_follows_its_files(tmp_path):
    tok = save_tokenizer(tmp_path / "tok")
    before = _cache_key(tok, [b"abc"], "--tokenizer")
    assert before == _cache_key(tok, [b"abc"], "--tokenizer")
    config = tok / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 7}))
    assert _cache_key(tok, [b"abc"], "--tokenizer") != before
