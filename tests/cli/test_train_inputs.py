"""``shardkit train --model-path``: a checkpoint directory without its tokenizer fails before
launch, with what to do (issue 23: it failed after a minute inside every worker, with
transformers' hint to install sentencepiece)."""

import shutil

import pytest

from harness.pretrained import save_tiny_llama
from shardkit.cli.main import main
from shardkit.train.tokens import TOKENIZER_FILES

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _weights_only(checkpoint, folder):
    shutil.copytree(checkpoint, folder)
    for name in (*TOKENIZER_FILES, "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    return folder


def test_a_checkpoint_without_tokenizer_fails_before_launch(checkpoint, tmp_path, capsys, monkeypatch):
    import shardkit.cli.launch as cli_launch

    monkeypatch.setattr(cli_launch, "launch_local", lambda *a, **k: pytest.fail("launched"))
    folder = _weights_only(checkpoint, tmp_path / "weights")
    assert main(["train", "--model-path", str(folder), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--model-path: {folder} has no tokenizer" in err and "tokenizer.json" in err
    assert "--local-dir" in err and "sentencepiece" not in err


def test_a_tokenizer_larger_than_the_embedding_fails_before_launch(checkpoint, tmp_path, capsys, monkeypatch):
    import json

    import shardkit.cli.launch as cli_launch

    monkeypatch.setattr(cli_launch, "launch_local", lambda *a, **k: pytest.fail("launched"))
    folder = tmp_path / "small"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 100  # fewer rows than the tokenizer's 400 tokens
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["train", "--model-path", str(folder), "--steps", "1"]) == 2
    assert "the tokenizer has" in capsys.readouterr().err
