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


def _tokenizer(tmp_path) -> str:
    # a folder with a tokenizer file: tokenizer_source accepts it by name, before any torch
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    return str(tmp_path / "tok")


def _nonempty(tmp_path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path)


def _hf_dataset(tmp_path) -> list[str]:
    from datasets import Dataset

    Dataset.from_dict({"body": ["a first document, long enough"]}).save_to_disk(str(tmp_path / "ds"))
    return ["--data", f"hf:{tmp_path / 'ds'}"]


CASES = {
    "layout": (lambda t: ["--tp", "3", "--nproc", "4"], "must divide --nproc 4"),
    "profile steps": (lambda t: ["--profile-steps", "3:2", "--report", str(t)], "--profile-steps must be A:B"),
    "memory snapshot on CPU": (
        lambda t: ["--memory-snapshot", "--report", str(t)],
        "--memory-snapshot records the CUDA caching allocator: it needs CUDA ranks",
    ),
    "nproc 1": (lambda t: ["--nproc", "1"], "add --tp 1 to run on 1 process(es)"),
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
    "schedule chunk layers": (
        lambda t: ["--pp", "2", "--schedule", "looped-bfs", "--virtual-stages", "3", "--layers", "4"],
        "4 decoder layers cannot fill 6 chunks",
    ),
    "schedule chunk range": (
        lambda t: ["--pp", "2", "--schedule", "zbv", "--virtual-stages", "3"],
        "--schedule zbv needs --virtual-stages 2, got 3",
    ),
    "mixed precision dtype": (
        lambda t: ["--mixed-precision", "bf16", "--dtype", "float64"],
        "it needs --dtype float32, got --dtype float64",
    ),
    "mixed precision name": (lambda t: _toml(t, 'mixed_precision = "fp8"\n'), "mixed precision must be one of"),
    "ac name": (lambda t: _toml(t, 'ac = "half"\n'), "activation checkpointing must be one of"),
    "compile with selective ac": (
        lambda t: ["--compile", "--ac", "selective"],
        "with selective activation checkpointing",
    ),
    "compile with mixed precision": (
        lambda t: ["--compile", "--mixed-precision", "bf16"],
        "--compile with --mixed-precision bf16",
    ),
    "selective ac with checks": (lambda t: ["--ac", "selective", "--checks"], "--ac selective with --checks"),
    "ep of a dense model": (lambda t: ["--ep", "2"], "--ep 2 needs a mixture-of-experts model"),
    "moe balancing, dense model": (lambda t: ["--moe-z-loss", "0.1"], "--moe-z-loss: 'llama' has no routed experts"),
    "moe bias rate": (
        lambda t: ["--model", "moe", "--moe-bias-update-rate", "-1"],
        "--moe-bias-update-rate must be a finite number >= 0",
    ),
    "moe capacity padding without a factor": (
        lambda t: ["--model", "moe", "--moe-pad-to-capacity"],
        "--moe-pad-to-capacity needs --moe-capacity-factor",
    ),
    "seq len": (lambda t: ["--seq-len", "1"], "--seq-len must be >= 2"),
    "cp tokens": (
        lambda t: ["--tp", "1", "--cp-ring", "4", "--nproc", "4", "--seq-len", "3"],
        "every cp rank needs at least one token",
    ),
    "packed with tokenizer": (lambda t: ["--tokenizer", _tokenizer(t), "--packed"], "--packed with --tokenizer"),
    "sequence parallel with pp-tp": (
        lambda t: ["--pp-tp", "2,1", "--nproc", "3", "--sequence-parallel", "--batch-size", "3"],
        "--sequence-parallel with --pp-tp",
    ),
    "spatial of an LM": (
        lambda t: ["--tp", "1", "--spatial", "2", "--nproc", "2"],
        "--spatial 2 needs --model conv-ae",
    ),
}


# Not yet without torch (none): a checkpoint's config (--model-path, transformers), the compile
# backend's name (torch's Dynamo registry) and the machine's memory estimate (the planner) are
# checked after import torch; tests/cli/test_train_inputs.py holds their refusals.
_TORCH_YET: set[str] = set()


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
        assert facts.experts == spec.experts
