"""The model-spec registry: every ``--model`` is one spec, looked up by name, nowhere else compared.

The registry's names are the CLI's ``--model`` choices; a ``--model-path`` checkpoint picks its
spec by family; the conv spec refuses what a convolutional model cannot take; and no module
outside the registry compares the model's name.
"""

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

import shardkit
from shardkit import ShardkitError
from shardkit.cli.train import add_train_parser
from shardkit.train.config import MODELS, TrainConfig, validate_config
from shardkit.train.specs import SPECS, model_spec, spec_of_family


def test_every_spec_is_registered_under_its_name():
    assert MODELS == tuple(SPECS) == ("llama", "qwen2", "qwen3", "moe", "mla", "gemma2", "conv-ae")
    for name, spec in SPECS.items():
        assert spec.name == name and model_spec(name) is spec
    with pytest.raises(TypeError):
        SPECS["gpt2"] = SPECS["llama"]  # read-only: nothing registers itself later
    with pytest.raises(dataclasses.FrozenInstanceError):
        SPECS["llama"].default_tp = 4


def test_the_cli_offers_the_registry(capsys):
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    for name in SPECS:
        assert parser.parse_args(["train", "--model", name]).model == name
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--model", "gpt2"])
    assert "--model {" + ",".join(SPECS) + "}" in capsys.readouterr().err  # the usage line lists them all


def test_unknown_names_and_families_are_refused():
    with pytest.raises(
        ShardkitError, match="--model must be one of llama, qwen2, qwen3, moe, mla, gemma2, conv-ae, got 'gpt2'"
    ):
        validate_config(TrainConfig(model="gpt2"))
    assert spec_of_family("qwen3_moe") is SPECS["moe"] and spec_of_family("deepseek_v2") is SPECS["mla"]
    assert spec_of_family("gemma2") is SPECS["gemma2"]
    with pytest.raises(ShardkitError, match="a 'gpt2' model; supported families: llama, qwen2"):
        spec_of_family("gpt2")


def test_the_specs_resolve_their_own_options():
    lm = validate_config(TrainConfig(model="qwen3"))
    assert (lm.tp, lm.nproc, lm.sequence_parallel) == (2, 4, True)  # dense: SP on with tp
    moe = validate_config(TrainConfig(model="moe"))
    assert moe.sequence_parallel is False  # MoE: off unless asked for
    conv = validate_config(TrainConfig(model="conv-ae", spatial=2))
    assert (conv.tp, conv.nproc, conv.sequence_parallel) == (1, 2, False)
    assert SPECS["conv-ae"].sample_size(conv) == 48 * 80 and SPECS["llama"].sample_size(lm) == lm.seq_len
    with pytest.raises(ShardkitError, match="--model-path loads causal LMs; --model conv-ae"):
        validate_config(TrainConfig(model="conv-ae", model_path="/nonexistent"))


def test_no_module_outside_the_registry_compares_the_model_name():
    src = Path(shardkit.__file__).parent
    pattern = re.compile(r"\bmodel\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(]|[\"']conv-ae[\"']\s*(==|!=|in)\b")
    hits = [
        f"{path.relative_to(src)}:{n}"
        for path in sorted(src.rglob("*.py"))
        if path.name != "specs.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert hits == []
