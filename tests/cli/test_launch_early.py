"""``shardkit train`` starts its forkserver right after the torch-free checks (issue 32, item 5):
its imports (torch, the model's modeling code, the trainer) then overlap the launcher's own for
the checks that need torch, instead of following them. Checked by the order of the calls and the
modules loaded at each, in a fresh interpreter (this one has torch imported), not by a timer."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import shardkit
from shardkit.cli._fork import forkserver_preload, modeling_modules
from shardkit.cli.train import ENTRY_MODULE
from shardkit.train.model_names import MODEL_FACTS
from shardkit.train.run import worker_main
from shardkit.train.specs import SPECS

SRC = os.path.dirname(os.path.dirname(shardkit.__file__))  # the shardkit under test, whatever the cwd
_ELASTIC = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE", "RANK")

# Records each step of run_train with whether torch is loaded by then; the forkserver is not
# started (its arguments are recorded) and the torch-dependent checks stop the command.
_PROBE = """
import json, sys
import shardkit.cli._fork as fork
import shardkit.cli.train as train
from shardkit.errors import ShardkitError
events, check_args = [], train.check_args

def checked(*args, **kwargs):
    events.append(["check_args", "torch" in sys.modules])
    return check_args(*args, **kwargs)

def start(modules, entry):
    events.append(["forkserver", "torch" in sys.modules, list(modules), entry])
    return fork.Forkserver([], "")

def finish(*args, **kwargs):
    events.append(["finish_args", "torch" in sys.modules])
    raise ShardkitError("stopped by the test")

train.check_args, train.finish_args, fork.Forkserver.start = checked, finish, staticmethod(start)
from shardkit.cli.main import main
argv = json.loads(sys.argv[1])
if sys.argv[2] == "own":  # the command line's: `shardkit train ...`
    sys.argv[1:] = argv
    rc = main()
else:  # a program calling main(argv)
    rc = main(argv)
print(json.dumps({"rc": rc, "events": events}))
"""


def _events(argv: list[str], elastic: dict[str, str] | None = None, how: str = "own") -> list:
    env = {k: v for k, v in os.environ.items() if k not in _ELASTIC}
    env.update(elastic or {})
    env["PYTHONPATH"] = os.pathsep.join([SRC, *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv), how], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.stdout.strip(), run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["rc"] == 2, run.stderr
    return out["events"]


def test_the_forkserver_starts_between_the_torch_free_checks_and_the_rest():
    assert _events(["train", "--steps", "1"]) == [
        ["check_args", False],
        ["forkserver", False, ["transformers.models.llama.modeling_llama"], ENTRY_MODULE],
        ["finish_args", False],
    ]


def test_a_program_calling_main_in_process_gets_no_early_forkserver():
    """Its process may run a forkserver of its own (pytest's harness, with other imports)."""
    assert _events(["train", "--steps", "1"], how="argv") == [["check_args", False], ["finish_args", False]]


def test_a_torch_free_error_starts_no_forkserver():
    assert _events(["train", "--tp", "3"]) == [["check_args", False]]  # 3 does not divide 4 ranks


def test_under_torchrun_there_is_no_forkserver():
    elastic = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "4"}
    assert _events(["train", "--steps", "1"], elastic) == [["check_args", False], ["finish_args", False]]


def test_the_forkserver_imports_the_entry_and_each_models_modeling_code():
    assert worker_main.__module__ == ENTRY_MODULE
    assert forkserver_preload([], ENTRY_MODULE) == forkserver_preload([], worker_main)
    for name, spec in SPECS.items():
        want = spec.family.model_type if spec.family is not None else None
        assert MODEL_FACTS[name].model_type == want, name
        modules = modeling_modules(name)
        assert modules == ([] if want is None else [f"transformers.models.{want}.modeling_{want}"])
        assert all(importlib.util.find_spec(m) is not None for m in modules), modules  # transformers has it


@pytest.mark.parametrize(
    "config, want",
    [
        ({"model_type": "qwen2"}, ["transformers.models.qwen2.modeling_qwen2"]),
        ({}, []),  # no model_type: nothing to preload, the checks say what is wrong
        (None, []),  # no config.json (a GGUF file, a missing folder): checked later
    ],
)
def test_a_model_path_preloads_its_checkpoints_family(tmp_path, config, want):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert modeling_modules("llama", str(tmp_path)) == want
