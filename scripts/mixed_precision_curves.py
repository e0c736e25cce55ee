"""Loss curves of float32, ``--mixed-precision bf16`` and pure ``--dtype bfloat16`` on the real corpus.

Runs ``shardkit train`` three times with the same seed, batches and layout (the default data: the
Python standard library's source tree), one variant each, and writes:

* ``OUT/NAME.png``: the three loss curves, and the relative gap of each bf16 variant to float32
  per step (``|loss - loss_fp32| / loss_fp32``);
* ``OUT/NAME.json``: the per-step losses, the gaps, and their maxima (the goal for mixed
  precision: within 1 % of float32 at every step).

Usage::

    python scripts/mixed_precision_curves.py --steps 300
    python scripts/mixed_precision_curves.py --steps 50 --train-args "--nproc 1 --tp 1"

Each run's own report (``report.json``, ``metrics.jsonl``) stays under ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {
    "float32": [],
    "mixed bf16 (fp32 masters and reductions)": ["--mixed-precision", "bf16"],
    "pure bfloat16": ["--dtype", "bfloat16"],
}
FP32 = "float32"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    p.add_argument("--out", default="docs/guides", help="folder of the plot and the numbers (default docs/guides)")
    p.add_argument("--name", default="mixed_precision_curves", help="file name stem (default mixed_precision_curves)")
    p.add_argument("--work-dir", default=None, help="folder of the runs' reports (default: a temporary folder)")
    p.add_argument(
        "--train-args", default="", help='more `shardkit train` flags for every run, e.g. "--nproc 1 --tp 1"'
    )
    return p.parse_args(argv)


def _run(variant: str, flags: list[str], steps: int, extra: list[str], report: Path) -> list[float]:
    """One ``shardkit train`` run; its per-step losses."""
    cmd = [sys.executable, "-m", "shardkit", "train", "--steps", str(steps), "--report", str(report), *extra, *flags]
    print(f"[{variant}] {shlex.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((report / "report.json").read_text())["losses"]


def gaps(losses: list[float], reference: list[float]) -> list[float]:
    """``|loss - ref| / |ref|`` per step (pure)."""
    return [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]


def _plot(curves: dict[str, list[float]], gap: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    color = {name: f"C{i}" for i, name in enumerate(curves)}  # one colour per variant in both panels
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, losses in curves.items():
        top.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1, color=color[name])
    top.set_ylabel("training loss (nats / token)")
    top.set_title(title)
    top.legend()
    for name, g in gap.items():
        bottom.plot(range(1, len(g) + 1), [100 * x for x in g], label=name, linewidth=1, color=color[name])
    bottom.axhline(1.0, color="grey", linestyle="--", linewidth=0.8, label="1 % goal")
    bottom.set_ylabel("relative gap to float32 (%)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    extra = shlex.split(args.train_args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        curves = {
            name: _run(name, flags, args.steps, extra, work / f"run{i}")
            for i, (name, flags) in enumerate(VARIANTS.items())
        }
    gap = {name: gaps(losses, curves[FP32]) for name, losses in curves.items() if name != FP32}
    summary = {name: {"max_rel_gap": max(g), "final_rel_gap": g[-1]} for name, g in gap.items()}
    title = f"{args.steps} steps, shardkit train {args.train_args or '(default layout)'}"
    _plot(curves, gap, out / f"{args.name}.png", title)
    numbers = {"steps": args.steps, "train_args": args.train_args, "summary": summary, "losses": curves, "gaps": gap}
    (out / f"{args.name}.json").write_text(json.dumps(numbers, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name}: max relative gap to float32 {s['max_rel_gap']:.3%}, final {s['final_rel_gap']:.3%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
