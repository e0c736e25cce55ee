"""The ``shardkit`` front door (issue 23): ``--help`` imports no torch, ``import shardkit`` is lazy,
and a mistyped command, flag or choice is answered with the closest known ones."""

import subprocess
import sys
import warnings

import pytest

import shardkit
from harness.limits import patient
from shardkit.cli.main import main, suggest


def _fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter (this one has torch imported already)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_imports_no_torch(argv):
    code = (
        "import sys\nfrom shardkit.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy'))\n"
        "assert not bad, bad\n"
        "assert not [m for m in sys.modules if m.startswith(('shardkit.comm', 'shardkit.train.specs'))]\n"
    )
    run = _fresh(code)
    assert run.returncode == 0, run.stderr
    assert "train" in run.stdout and ("plan" in run.stdout or "--dp-shard" in run.stdout)


def test_the_flags_vocabularies_agree_with_the_library_and_the_registry():
    from shardkit.parallelize.checkpointing import AC_MODES
    from shardkit.parallelize.mixed_precision import MIXED_PRECISION
    from shardkit.pipeline_parallel.tables import SCHEDULES
    from shardkit.train import options
    from shardkit.train.model_names import MODEL_SUMMARIES
    from shardkit.train.specs import SPECS

    assert options.AC_MODES == AC_MODES and options.MIXED_PRECISION == MIXED_PRECISION
    assert options.SCHEDULES == tuple(SCHEDULES)
    assert tuple(SPECS) == tuple(MODEL_SUMMARIES)
    assert all(spec.summary == MODEL_SUMMARIES[name] for name, spec in SPECS.items())


def test_python_m_shardkit_help_imports_no_torch():
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shardkit", "--help"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if "|" in line}
    assert "shardkit.cli.main" in imported and "torch" not in imported


def test_import_shardkit_is_lazy_and_resolves_every_export():
    run = _fresh("import sys, shardkit\nassert 'torch' not in sys.modules\n")
    assert run.returncode == 0, run.stderr
    for name in shardkit.__all__:
        assert getattr(shardkit, name) is not None, name
    assert shardkit.tensor_parallel.__name__ == "shardkit.tensor_parallel"  # a sub-package by attribute
    assert set(shardkit.__all__) <= set(dir(shardkit))
    with pytest.raises(AttributeError, match="no_such_name"):
        shardkit.no_such_name  # noqa: B018


def test_a_moved_module_by_attribute_still_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert shardkit.layouts.__name__ == "shardkit.sharding.layouts"
    assert any("shardkit.sharding.layouts" in str(w.message) for w in caught)


@pytest.mark.parametrize(
    ("argv", "usage", "hint"),
    [
        (["trian"], "usage: shardkit [", "(did you mean train?)"),
        (["train", "--tp-size", "2"], "usage: shardkit train", "(did you mean --tp"),
        (["train", "--stpes", "3"], "usage: shardkit train", "(did you mean --steps"),
        (["train", "--model", "lama"], "usage: shardkit train", "(did you mean llama?)"),
        (["plan", "--gpu", "8", "--config", "x.json", "--presets", "h100"], "usage: shardkit plan", "--preset"),
    ],
)
def test_a_mistyped_name_gets_the_closest_ones(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert usage in err and hint in err, err


def test_suggest_says_nothing_without_a_close_match():
    assert suggest("--zzzz", ["--tp", "--pp"]) == ""
    assert suggest("--tp-size", ["--tp", "--pp", "--tp-degree"]).startswith(" (did you mean --tp")


@pytest.mark.slow  # a fresh interpreter importing shardkit and torch (2.3 core-s)
def test_an_export_named_like_its_sub_package_stays_the_export():
    """``shardkit.parallelize`` is the function even after ``shardkit.parallelize.*`` is imported
    (the lazy exports once let the import system replace it by the sub-package)."""
    code = (
        "import shardkit.parallelize.decoder, shardkit, inspect, sys; "
        "assert inspect.isfunction(shardkit.parallelize), shardkit.parallelize; "
        "assert sys.modules['shardkit.parallelize'].decoder_layers; "
        "from shardkit.parallelize import parallelize_stage; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patient(120))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
