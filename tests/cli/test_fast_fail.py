"""``shardkit train`` refuses bad input before ``import torch`` (issue 32 item 1): each kind of
pre-launch error that needs no tensor is printed while ``torch`` is not in ``sys.modules``
(modules counted, not seconds: a busy machine makes any timer lie)."""

import json
import os
import subprocess
import sys

import pytest

import shardkit

SRC = os.path.dirname(os.path.dirname(shardkit.__file__))  # the shardkit under test, whatever the cwd

# Runs main() in a fresh interpreter (the test's own has torch imported) and says, after the
# error is printed and main has returned, whether torch was ever imported.
_PROBE = (
    "import importlib, json, sys\n"
    "main = importlib.import_module('shardkit.cli.main').main\n"
    "rc = main(json.loads(sys.argv[1]))\n"
    "print(json.dumps({'rc': rc, 'torch': 'torch' in sys.modules}))\n"
)


def _run(argv: list[str], cwd) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE", "RANK")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )
    assert run.stdout.strip(), run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def _toml(tmp_path, text: str) -> list[str]:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return ["--config", str(path)]


def _jsonl(tmp_path) -> list[str]:
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a first document, long enough"}\n{not json\n')
    return ["--data", str(path)]


def _file(tmp_path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file" / "report")


def _nonempty(tmp_path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path)


def _hf_dataset(tmp_path) -> list[str]:
    from datasets import Dataset

    Dataset.from_dict({"body": ["a first document, long enough"]}).save_to_disk(str(tmp_path / "ds"))
    return ["--data", f"hf:{tmp_path / 'ds'}"]


CASES = {
    "layout": (lambda t: ["--tp", "3", "--nproc", "4"], "must divide --nproc 4"),
    "heads": (lambda t: ["--hidden-size", "64", "--heads", "6", "--kv-heads", "2"], "divisible by --heads 6"),
    "tp heads": (
        lambda t: ["--tp", "4", "--hidden-size", "64", "--heads", "2", "--kv-heads", "2"],
        "--tp 4: 2 query heads cannot be split over tp=4",
    ),
    "path": (lambda t: ["--report", _file(t)], "exists and is not a directory"),
    "save-hf folder": (lambda t: ["--save-hf", _nonempty(t)], "is not empty"),
    "data path": (lambda t: ["--data", str(t / "missing.txt")], "is neither a file nor a folder"),
    "toml key": (lambda t: _toml(t, "stepz = 3\n"), "unknown key 'stepz'"),
    "toml type": (lambda t: _toml(t, 'steps = "three"\n'), "steps in"),
    "tokenizer file": (lambda t: ["--tokenizer", str(t)], "has no tokenizer"),
    "jsonl line": (_jsonl, "docs.jsonl:2: not a JSON line"),
    "hf dataset column": (_hf_dataset, "no column 'text' (--data-column text); the dataset's columns: 'body'"),
    "wandb project": (lambda t: ["--wandb", "team/proj"], "is not a W&B project name"),
    "schedule rule": (lambda t: ["--schedule", "interleaved-1f1b", "--virtual-stages", "2"], "need a pipeline"),
    "schedule table rule": (
        lambda t: ["--pp", "2", "--schedule", "interleaved-1f1b", "--virtual-stages", "2", "--microbatches", "3"],
        "microbatches must be a multiple of pp",
    ),
}


# Not yet without torch: the schedule's table rules (microbatches, layers per chunk) read the
# registry pipeline_parallel.tables, whose package and schedules module import torch.
_TORCH_YET = {"schedule table rule"}


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.xfail(strict=True)) if k in _TORCH_YET else k for k in CASES]
)
def test_the_error_is_printed_before_torch_is_imported(kind, tmp_path):
    make_args, message = CASES[kind]
    out, stderr = _run(["train", *make_args(tmp_path)], cwd=tmp_path)
    assert out["rc"] == 2 and message in stderr, stderr
    assert "shardkit train: error:" in stderr
    assert not out["torch"], f"{kind}: torch was imported before the error: {stderr}"


def test_the_facts_the_launcher_reads_are_the_specs():
    from shardkit.train.model_names import MODEL_FACTS
    from shardkit.train.specs import SPECS

    assert list(MODEL_FACTS) == list(SPECS)
    for name, spec in SPECS.items():
        facts = MODEL_FACTS[name]
        assert (facts.reads_corpus, facts.default_tp, facts.min_nproc) == (
            spec.reads_corpus,
            spec.default_tp,
            spec.min_nproc,
        )
        assert facts.decoder == (spec.family is not None)
