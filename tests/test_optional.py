"""A missing optional dependency: one line naming the extra, before any process starts."""

from __future__ import annotations

import pytest

from shardkit._optional import MissingExtraError, check_train, install_hint, missing, require
from shardkit.cli.main import main


@pytest.fixture
def no_transformers(hide_module):
    hide_module("transformers")


@pytest.fixture
def no_matplotlib(hide_module):
    hide_module("matplotlib")


@pytest.fixture
def no_tensorboard(hide_module):
    hide_module("tensorboard")


def test_require_names_the_extra(no_transformers):
    assert missing(["transformers", "torch"]) == ["transformers"]
    with pytest.raises(MissingExtraError) as info:
        require(["transformers"], "shardkit train --model llama")
    assert str(info.value) == (
        "shardkit train --model llama needs transformers, which is not installed: pip install 'shardkit[hf]'"
    )


def test_install_hint_merges_extras():
    assert install_hint(["matplotlib", "transformers", "safetensors"]) == "pip install 'shardkit[hf,plot]'"


def test_train_without_transformers_says_pip_install_hf(no_transformers, capsys):
    assert main(["train", "--model", "llama", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "shardkit train: error: shardkit train --model llama needs transformers, which is not installed: "
        "pip install 'shardkit[hf]'"
    ]


def test_train_model_path_without_transformers(no_transformers, capsys, tmp_path):
    assert main(["train", "--model-path", str(tmp_path), "--steps", "1"]) == 2
    assert "pip install 'shardkit[hf]'" in capsys.readouterr().err


def test_conv_ae_without_matplotlib_says_pip_install_plot(no_matplotlib, capsys):
    assert main(["train", "--model", "conv-ae", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("pip install 'shardkit[plot]'"), err


def test_report_without_matplotlib_is_one_note(no_matplotlib, no_tensorboard):
    notes = check_train(["transformers"], "shardkit train --model llama", "reports/run1")
    assert notes == [
        "loss.png will not be written (matplotlib is not installed): pip install 'shardkit[plot]'",
        "TensorBoard scalars (DIR/tb) will not be written (tensorboard is not installed): pip install 'shardkit[tb]'",
    ]
    assert check_train(["transformers"], "shardkit train --model llama", None) == []


def test_report_without_tensorboard_is_one_note(no_tensorboard):
    assert missing(["tensorboard", "matplotlib"]) == ["tensorboard"]
    assert check_train(["matplotlib"], "shardkit train --model conv-ae (its sample photo)", "out") == [
        "TensorBoard scalars (DIR/tb) will not be written (tensorboard is not installed): pip install 'shardkit[tb]'"
    ]


def test_report_with_every_extra_has_no_note():
    # tensorboard is in the test extra: the suite checks the path that writes DIR/tb
    assert check_train(["transformers"], "shardkit train --model llama", "out") == []


def test_help_describes_train_honestly(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "small Llama" not in out and "Hugging Face causal LM" in out


def test_third_party_output_on_rank_0_only(monkeypatch):
    import os
    import warnings

    from transformers.utils import logging as hf_logging

    from shardkit._quiet import BAR_ENV, QUIET_ENV, quiet_third_party

    for key in QUIET_ENV:
        monkeypatch.delenv(key, raising=False)
    import tqdm.std

    monkeypatch.setattr(tqdm.std.tqdm, "__init__", tqdm.std.tqdm.__init__)  # rank 1 turns tqdm off: undone after
    was_enabled, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    with warnings.catch_warnings():  # huggingface_hub notes that the test env disables bars anyway
        warnings.simplefilter("ignore")
        hf_logging.enable_progress_bar()
    try:
        with warnings.catch_warnings():
            quiet_third_party(0)  # rank 0: its warnings and logs stay; no bars (issue 32), as every rank
            assert all(os.environ[k] == v for k, v in BAR_ENV.items())
            assert not any(k in os.environ for k in QUIET_ENV if k not in BAR_ENV)
            assert not hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() == level
            quiet_third_party(1)
            assert all(os.environ[k] == v for k, v in QUIET_ENV.items())
            assert not hf_logging.is_progress_bar_enabled()
            assert hf_logging.get_verbosity() == hf_logging.ERROR
    finally:
        with warnings.catch_warnings():  # huggingface_hub notes that the test env disables bars anyway
            warnings.simplefilter("ignore")
            (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
        hf_logging.set_verbosity(level)
