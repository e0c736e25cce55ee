"""Where every public name of shardkit is documented: ``shardkit.__all__`` -> docs page.

Reads the built site (the pages mkdocstrings rendered, so a name counts as documented only if
its docstring is really on a page) and the guides (which of them use the name in code):

    python -m mkdocs build --strict -d site && python scripts/public_api_table.py site
    python scripts/public_api_table.py          # builds the site into a temporary folder first

Prints a Markdown table: name, kind, the API page and anchor that render it, the guides that use
it. Exit status 1 if a public name is rendered on no page. tests/test_docs.py runs the same check.
"""

from __future__ import annotations

import argparse
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_ANCHOR = re.compile(r'id="(shardkit\.[A-Za-z0-9_.]+)"')


def _resolve(path: str) -> list[object]:
    """The objects a dotted anchor can name. A package attribute may shadow its submodule of the
    same name (``shardkit.comm.all_to_all`` is a function and a module), so both readings count:
    attributes from ``shardkit`` down, and the longest importable module path, then attributes."""
    import importlib

    import shardkit

    found: list[object] = []
    obj: object = shardkit
    try:
        for attr in path.split(".")[1:]:
            obj = getattr(obj, attr)
        found.append(obj)
    except AttributeError:
        pass
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            found.append(obj)
        except AttributeError:
            pass
        break
    return found


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if inspect.isfunction(obj):
        return "function"
    if inspect.ismodule(obj):
        return "module"
    return "type alias" if "Union" in type(obj).__name__ or "Alias" in type(obj).__name__ else "object"


def _guides_using(name: str) -> list[str]:
    """Guides whose code (a python block or inline code) uses ``name``."""
    out = []
    word = re.compile(rf"(?<![\w.])(shardkit\.)?{re.escape(name)}\b")
    for path in sorted((DOCS / "guides").glob("*.md")):
        text = path.read_text()
        code = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) + re.findall(r"`([^`\n]+)`", text)
        if any(word.search(c) for c in code):
            out.append(str(path.relative_to(DOCS)))
    return out


def public_api_table(site: Path) -> list[dict[str, Any]]:
    """One row per name of ``shardkit.__all__``: ``name``, ``kind``, ``pages`` (the API pages,
    as docs/ sources, and anchors that render it) and ``guides``."""
    import shardkit

    rendered: dict[str, list[tuple[str, str]]] = {}
    for html in sorted(site.rglob("index.html")):
        rel = html.parent.relative_to(site)
        page = f"{rel}.md" if str(rel) != "." else "index.md"
        for anchor in dict.fromkeys(_ANCHOR.findall(html.read_text())):
            rendered.setdefault(anchor.rsplit(".", 1)[-1], []).append((page, anchor))
    rows = []
    for name in shardkit.__all__:
        obj = getattr(shardkit, name)
        pages = [(page, anchor) for page, anchor in rendered.get(name, []) if any(o is obj for o in _resolve(anchor))]
        rows.append({"name": name, "kind": _kind(obj), "pages": pages, "guides": _guides_using(name)})
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| public name | kind | documented on (API page#anchor) | guides using it |", "| --- | --- | --- | --- |"]
    for r in rows:
        pages = ", ".join(f"{p}#{a}" for p, a in r["pages"]) or "**not rendered**"
        guides = ", ".join(r["guides"]) or "-"
        lines.append(f"| `{r['name']}` | {r['kind']} | {pages} | {guides} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", help="a built mkdocs site (default: build one into a temporary folder)")
    args = parser.parse_args(argv)
    if args.site:
        site = Path(args.site)
    else:
        site = Path(tempfile.mkdtemp(prefix="shardkit-site-"))
        subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT, check=True
        )
    rows = public_api_table(site)
    print(to_markdown(rows))
    missing = [r["name"] for r in rows if not r["pages"]]
    if missing:
        print(f"\nnot rendered on any page: {missing}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
