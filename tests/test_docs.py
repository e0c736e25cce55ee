"""The documentation: it builds with no warning, and every Python example in it runs.

Every ```python block in docs/ starts with ``# torchrun --nproc-per-node N <name>.py``: how a user
runs it. Here each block runs on every rank of the persistent N-rank gloo world instead
(tests/harness), with ``dist.init_process_group`` / ``destroy_process_group`` left to the world:
the same code, without paying a process launch per example. Examples assert their own results
(parity, exact collective counts), so a block that runs is a block that is right.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardkit
from harness.limits import patient

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"^# torchrun --nproc-per-node (\d+) \S+\.py\n")


def _examples() -> list[tuple[str, int, str]]:
    """(id, world size, code) of every python block under docs/."""
    out = []
    for path in sorted(DOCS.rglob("*.md")):
        for i, m in enumerate(_BLOCK.finditer(path.read_text())):
            code = m.group(1)
            marker = _MARKER.match(code)
            n = int(marker.group(1)) if marker else 0
            out.append((f"{path.relative_to(DOCS)}#{i}", n, code))
    return out


EXAMPLES = _examples()


def _by_size(n: int) -> list:
    return [pytest.param(code, id=name) for name, size, code in EXAMPLES if size == n]


def test_every_example_says_how_to_run_it():
    bad = [name for name, n, _ in EXAMPLES if n not in (2, 4)]
    assert not bad, f"python blocks without a '# torchrun --nproc-per-node 2|4 NAME.py' first line: {bad}"
    assert len(EXAMPLES) >= 8


def _run(code: str) -> None:
    import torch.distributed as dist

    saved = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *a, **k: None  # the world's group is already up
    dist.destroy_process_group = lambda *a, **k: None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "<docs example>", "exec"), {"__name__": "__main__"})
    finally:
        dist.init_process_group, dist.destroy_process_group = saved


@pytest.mark.world(2)
@pytest.mark.parametrize("code", _by_size(2))
def test_example_2_ranks(code):
    _run(code)


@pytest.mark.world(4)
@pytest.mark.parametrize("code", _by_size(4))
def test_example_4_ranks(code):
    _run(code)


def test_api_index_lists_every_public_name():
    index = (DOCS / "api" / "index.md").read_text()
    missing = [name for name in shardkit.__all__ if f"`{name}`" not in index]
    assert not missing, f"docs/api/index.md does not list {missing}"


def test_no_reference_to_a_missing_design_file():
    old = "DESIGN" + ".md"  # spelled apart, so that this file does not match itself
    hits = [
        str(p.relative_to(ROOT))
        for d in ("src", "tests", "benchmarks", "docs")
        for p in [*(ROOT / d).rglob("*.py"), *(ROOT / d).rglob("*.md")]
        if old in p.read_text()
    ]
    assert not hits, f"{old} is docs/design.md now: {hits}"


# A project path in prose: ``tests/cli/test_x.py``, ``comm/_c10d.py``, ``docs/guides/data.md``.
_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|sh))\b")
# A bare test or bench file name (``test_ring.py``, ``cases_pp.py``): it names a file of this
# project; other bare names (``first.py``) are what a user calls an example.
_BARE = re.compile(r"(?<![\w./-])((?:test|cases)_\w+\.py)\b")
# Paths of other projects cited as sources (nccl-tests' bus bandwidth notes).
_EXTERNAL = {"doc/PERFORMANCE.md"}
# Where a relative path may start: the citing file's folder, the checkout, src/, the package, docs/.
_BASES = (ROOT, ROOT / "src", ROOT / "src" / "shardkit", DOCS)


def _missing_paths(path: Path) -> list[str]:
    """The paths ``path`` mentions that exist nowhere in the checkout. A mention after "former"
    (a removed file cited as the source of old numbers) is history, not a reference."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        for m in _PATH.finditer(line):
            ref = m.group(1)
            placeholder = ref.split("/")[0].isupper()  # ``DIR/bench.md``: a folder the user names
            if placeholder or ref in _EXTERNAL or "former" in line[max(0, m.start() - 12) : m.start()]:
                continue
            if not any((base / ref).exists() for base in (path.parent, *_BASES)):
                out.append(f"{path.relative_to(ROOT)}:{i}: {ref}")
        for m in _BARE.finditer(line):
            if not any(next((ROOT / d).rglob(m.group(1)), None) for d in ("tests", "src")):
                out.append(f"{path.relative_to(ROOT)}:{i}: {m.group(1)}")
    return out


def _citing_files() -> list[Path]:
    return [
        *DOCS.rglob("*.md"),
        ROOT / "README.md",
        ROOT / "benchmarks" / "RESULTS.md",
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "scripts").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
    ]


def test_every_path_the_docs_and_sources_mention_exists():
    missing = [hit for path in _citing_files() for hit in _missing_paths(path)]
    assert not missing, "references to files that do not exist:\n" + "\n".join(missing)


def test_a_missing_path_is_found(tmp_path):
    doc = ROOT / "docs" / "_probe_missing_path.md"  # inside the checkout, as a real page would be
    doc.write_text("see `benchmarks/bench_gone.py` and test_nowhere.py; the former `scripts/x.py` is history\n")
    try:
        assert [h.split(": ")[1] for h in _missing_paths(doc)] == ["benchmarks/bench_gone.py", "test_nowhere.py"]
    finally:
        doc.unlink()


@pytest.mark.meta
def test_docs_build_strict(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        # No -q: it hid griffe warnings (grouped parameter names) that a plain --strict build fails on.
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patient(600),
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert (tmp_path / "site" / "api" / "comm" / "index.html").read_text().count("all_to_all") > 3
    _check_public_names_rendered(tmp_path / "site")


def _check_public_names_rendered(site: Path) -> None:
    """Every name of shardkit.__all__ has its docstring rendered on an API page (its anchor), and
    the page the API index names for it is one of those pages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("public_api_table", ROOT / "scripts" / "public_api_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    rows = table.public_api_table(site)
    assert [r["name"] for r in rows] == list(shardkit.__all__)
    missing = [r["name"] for r in rows if not r["pages"]]
    assert not missing, f"public names whose docstring no page renders: {missing}"
    index = (DOCS / "api" / "index.md").read_text()
    listed = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| \[[^]]+\]\(([\w.]+)\)", index, re.M))
    wrong = {
        r["name"]: (listed.get(r["name"]), r["pages"])
        for r in rows
        if f"api/{listed.get(r['name'])}" not in [page for page, _ in r["pages"]]
    }
    assert not wrong, f"docs/api/index.md names a page that does not render them: {wrong}"


def _train_commands() -> list[str]:
    """Every ``shardkit train ...`` command the docs and the README show (inline or in a block)."""
    texts = [p.read_text() for p in sorted(DOCS.rglob("*.md"))] + [(ROOT / "README.md").read_text()]
    found = set()
    for text in texts:
        found.update(re.findall(r"`(shardkit train[^`]*)`", text))
        found.update(line.split("#")[0] for line in text.splitlines() if line.startswith("shardkit train"))
    # --help exits; --model-path and --tokenizer need files, as do the page's notes.jsonl and hf:
    # dataset examples; "T0,T1,..." is the README's flag synopsis
    return sorted(c.strip() for c in found if not re.search(r"--help|--model-path|--tokenizer|\.jsonl|hf:|T0,", c))


@pytest.mark.parametrize("command", _train_commands())
def test_every_train_command_in_the_docs_is_a_valid_layout(command):
    """The shell examples parse, and their layout passes the checks ``shardkit train`` runs before
    any launch (placeholders N and M read as 2); the layouts themselves train in tests/cli."""
    import shlex

    from shardkit.cli.main import build_parser
    from shardkit.cli.train import config_from_args

    argv = ["2" if word in ("N", "M") else word for word in shlex.split(command)[1:]]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.nproc >= 1 and cfg.steps >= 1


def test_train_commands_are_found():
    assert len(_train_commands()) >= 10
