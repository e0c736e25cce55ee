"""docs/guides/own-data.md lists every key of the TOML config, as the options dataclass has it
(issue 23, item 7): a new option without a row, or a changed default, fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from shardkit.train.config import load_toml
from shardkit.train.options import TrainConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "own-data.md"
_ROW = re.compile(r"^\| `(\w+)` \| (\w+) \| ([^|]+) \| (.*) \|$")


def _rows() -> dict[str, tuple[str, str]]:
    return {m.group(1): (m.group(2), m.group(3).strip()) for m in map(_ROW.match, PAGE.read_text().splitlines()) if m}


def _expected() -> dict[str, tuple[str, str]]:
    """key -> (type, default) as the page writes them: ``unset`` for a None default."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name == "config":  # the file itself, not a key of it
            continue
        kind = str(f.type).replace(" | None", "")
        d = f.default
        text = (
            "unset"
            if d is None
            else str(d).lower()
            if isinstance(d, bool)
            else f'"{d}"'
            if isinstance(d, str)
            else repr(d)
        )
        out[f.name] = (kind, text)
    return out


def test_the_page_lists_every_key_with_its_type_and_default():
    rows, want = _rows(), _expected()
    missing = [f"| `{k}` | {t} | {d} | ... |" for k, (t, d) in want.items() if k not in rows]
    assert not missing, "rows to add to docs/guides/own-data.md:\n" + "\n".join(missing)
    assert not set(rows) - set(want), f"keys the page lists that TrainConfig lacks: {set(rows) - set(want)}"
    wrong = {k: (rows[k], want[k]) for k in want if rows[k] != want[k]}
    assert not wrong, f"(page, TrainConfig) type and default differ: {wrong}"


def test_the_page_example_is_a_valid_config(tmp_path):
    example = PAGE.read_text().split("```toml", 1)[1].split("```", 1)[0]
    path = tmp_path / "run.toml"
    path.write_text(example)
    values = load_toml(path)
    assert values["tp"] == 2 and values["model_path"] == "/models/SmolLM2-135M" and len(values) == 11
