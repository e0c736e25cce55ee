"""``shardkit plan --config`` takes what ``shardkit train --model-path`` takes (issue 23)."""

import json

import pytest

from harness.tiny_lm import TINY_LLAMA_CONFIG as TINY
from shardkit.cli.main import main


def _plan(config, tmp_path):
    return main(["plan", "--config", str(config), "--gpus", "4", "--seq-len", "64", "--global-batch", "8",
                 "--top", "2", "--plot", str(tmp_path / "p.png")])  # fmt: skip


def test_plan_takes_a_checkpoint_directory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert _plan(tmp_path, tmp_path) == 0
    assert "fastest 2 layouts" in capsys.readouterr().out


def test_a_directory_without_config_json_is_one_clear_line(tmp_path, capsys):
    assert _plan(tmp_path, tmp_path) == 2
    out = capsys.readouterr().out
    assert out.startswith("shardkit plan: --config: the directory") and "has no config.json" in out


def test_plan_takes_the_tiny_gguf(tmp_path, capsys):
    pytest.importorskip("gguf")
    from shardkit.train.pretrained import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("no SmolLM2 GGUF file on this machine")
    assert _plan(path, tmp_path) == 0
    assert "B parameters" in capsys.readouterr().out
