"""Run the bad-input catalogue (tests/catalogue) in both modes and print the table of outcomes.

    python scripts/bad_input_table.py                  # every case; the table, then goal violations
    python scripts/bad_input_table.py -v               # one line per case and mode as they run
    python scripts/bad_input_table.py -k all_to_all    # only cases whose name contains a string
    python scripts/bad_input_table.py --docs           # also write the table into docs/reliability.md

Each case runs on every rank of a 1- to 4-rank gloo world (tests/harness), in the default mode
and in the check mode, and is classified automatically (tests/catalogue/bad_input_runner.py).
``tests/catalogue/test_bad_input_catalogue.py`` runs the same catalogue and asserts its goals.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "reliability.md"
BEGIN, END = "<!-- bad-input table: begin -->", "<!-- bad-input table: end -->"


def write_docs(text: str) -> None:
    """Replace the table between the markers of docs/reliability.md."""
    page = DOCS.read_text()
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise SystemExit(f"{DOCS}: markers {BEGIN} / {END} not found")
    DOCS.write_text(pattern.sub(lambda _: f"{BEGIN}\n{text}\n{END}", page))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only cases whose name contains this string")
    parser.add_argument("-v", action="store_true", help="print every case and mode as it runs")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/reliability.md")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "tests" / "catalogue"), str(ROOT / "tests")]
    import bad_input_runner as runner

    cases = [c for c in runner.all_cases() if args.k in c.name]

    def verbose(r):
        print(f"{r.case.name:58s} {r.mode:10s} {r.outcome:12s} {r.detail[:200]}", flush=True)

    start = time.monotonic()
    results = runner.run_catalogue(cases, progress=verbose if args.v else None)
    text = runner.table(results)
    print(text)
    print(f"{len(cases)} cases x 2 modes in {time.monotonic() - start:.0f} s")
    failures = runner.goal_failures(results)
    print("\n".join(["goal violations:", *map(runner.describe, failures)]) if failures else "every goal met")
    if args.docs:
        write_docs(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
