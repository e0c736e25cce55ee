"""Docstrings that the API pages render without griffe warnings (issue 23, item 7).

griffe (mkdocstrings) reads each entry of a Google-style ``Args:`` or ``Attributes:`` section as
one parameter: ``stride, dilation: ...`` is a parameter named "stride, dilation" that is not in
the signature, a warning that fails ``mkdocs build --strict``. Every string of the sources is
checked, so shared templates (``_ARGS`` appended to ``__doc__``) and pages not yet rendered count.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shardkit"
_SECTION = re.compile(r"^(\s*)([A-Z][A-Za-z ]*):\s*$")
_GROUPED = re.compile(r"^(\s*)(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)+)(\s*\([^)]*\))?:(\s|$)")
_NAMED = ("Args", "Arguments", "Parameters", "Attributes", "Keyword Args", "Other Parameters")


def grouped_entries(doc: str) -> list[str]:
    """The entries of ``doc``'s parameter sections that name several parameters at once."""
    found, section, indent = [], None, 0
    for line in inspect.cleandoc(doc).splitlines():
        if m := _SECTION.match(line):
            section, indent = m.group(2), len(m.group(1))
            continue
        if section not in _NAMED:
            continue
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            section = None
        elif (m := _GROUPED.match(line)) and len(m.group(1)) == indent + 4:
            found.append(m.group(2))
    return found


def test_every_parameter_entry_names_one_parameter():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                bad += [f"{path.relative_to(SRC)}:{node.lineno}: {e}" for e in grouped_entries(node.value)]
    assert not bad, f"one parameter per docstring entry (griffe reads 'a, b:' as one name): {bad}"


def test_a_grouped_entry_is_found():
    doc = """Pool.

    Args:
        x: input.
        stride, padding: as torch.
            More text: not an entry.

    Returns:
        a, b: not a parameter section.
    """
    assert grouped_entries(doc) == ["stride, padding"]
