"""Summaries and outputs of ``shardkit bench``: ``bench.json``, a markdown table and PNG charts.

Charts: one per unit, as the ratios' spreads differ by orders of magnitude between them:
``bench_ratios.png`` (unitless ratios and bubble fractions, log axis around 1),
``bench_us.png`` (host microseconds above a baseline) and ``bench_busbw.png`` (GB/s against
message size); at most :data:`ROWS_PER_CHART` bars a chart, more continue in ``bench_ratios_2.png``
and so on, so that each reads at 100 % zoom.

Per record: the median time of each variant, each per-round ratio's median with its spread
(p10, q1, q3, p90) and whether the median meets its goal, and the bus bandwidth of each variant
(nccl-tests: bytes per rank / time x factor: all_reduce ``2(n-1)/n``; all_gather,
reduce_scatter, all_to_all ``(n-1)/n``; send/recv 1), the same on gloo and NCCL; then the cases
the run skipped (a world of the wrong size) with their reasons.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from datetime import UTC, datetime

import torch

from ._method import quantiles

__all__ = [
    "summarize",
    "environment",
    "backend_name",
    "write_outputs",
    "markdown",
    "chart_pages",
    "unit",
    "SCHEMA_VERSION",
]

SCHEMA_VERSION = 1


def summarize(record: dict) -> dict:
    """The summary row of one record (see the module docstring)."""
    ms = {k: 1e3 * quantiles(v)["median"] for k, v in record["times_s"].items()}
    ratios = {}
    for name, r in record["ratios"].items():
        q = quantiles(r["values"])
        ratios[name] = dict(q, goal=r["goal"], met=None if r["goal"] is None else q["median"] <= r["goal"])
    busbw = {k: b["bytes"] / (ms[k] / 1e3) * b["factor"] / 1e9 for k, b in record["busbw"].items()}
    return dict(
        case=record["case"],
        label=_label(record),
        nproc=record["nproc"],
        params=record["params"],
        ms=ms,
        ratios=ratios,
        busbw_GBps=busbw,
        checked=record["checked"],
    )


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _label(record: dict) -> str:
    p = record["params"]
    parts = [_size(p["bytes"])] if "bytes" in p else []
    if "label" in p:
        parts.append(str(p["label"]))
    return " ".join(parts) or record["case"]


def backend_name(device: str) -> str:
    """``"gloo (CPU)"``, or ``"nccl (CUDA: <the GPU's name>)"``."""
    if device == "cpu":
        return "gloo (CPU)"
    return f"nccl (CUDA: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda})"


def environment(argv: list[str], backend: str = "gloo (CPU)") -> dict:
    import transformers

    return dict(
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=platform.machine(),
        processor=platform.processor() or platform.machine(),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        backend=backend,
        command="shardkit bench " + " ".join(argv),
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    )


def markdown(rows: list[dict], env: dict, settings: dict, skipped: Sequence[dict] = ()) -> str:
    """One table, one line per (record, ratio): median [p10, p90], goal, met; then the skipped
    cases with their reasons."""
    out = [
        f"shardkit bench, {env['date']}: {env['backend']}, {env['cpus']} CPUs ({env['processor']}), "
        f"Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}; "
        f"{settings['rounds']} rounds after {settings['warmup']} warm-up per case, median [p10, p90] of "
        f"per-round ratios (per-op time = max over ranks); `{env['command']}`",
        "",
        "| case | R | params | ratio | median [p10, p90] | goal | met | times ms (median) | busbw GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        times = ", ".join(f"{k} {v:.3g}" for k, v in row["ms"].items())
        bw = ", ".join(f"{k} {v:.2f}" for k, v in row["busbw_GBps"].items()) or "-"
        for name, q in row["ratios"].items():
            goal = "-" if q["goal"] is None else f"<= {q['goal']}"
            met = "-" if q["met"] is None else ("yes" if q["met"] else "**no**")
            out.append(
                f"| {row['case']} | {row['nproc']} | {row['label']} | {name} | {q['median']:.3f} "
                f"[{q['p10']:.3f}, {q['p90']:.3f}] | {goal} | {met} | {times} | {bw} |"
            )
    if skipped:
        out += ["", f"Skipped or failed (not passed): {len(skipped)} case(s)", ""]
        out += [f"- {s['case']}: {s['reason']}" for s in skipped]
    return "\n".join(out) + "\n"


# Charts a person reads at 100 % zoom: at most ROWS_PER_CHART bars a chart (0.3 in a bar at DPI:
# about 1500 px tall at most; the full suite's rows continue on bench_ratios_2.png, ...), 8-point
# labels, one chart per unit so that microsecond rows never squash the ratios near 1.
ROWS_PER_CHART = 45
DPI = 100
UNITS = {  # unit -> (file stem, x-axis label)
    "ratio": ("bench_ratios", "per-round ratio: median (dot), p10-p90 (line); black tick = goal (green met, red not)"),
    "us": ("bench_us", "microseconds per call above the baseline: median (dot), p10-p90 (line); black tick = goal"),
}


def unit(ratio_name: str) -> str:
    """``"us"`` for a per-round difference in microseconds (its name ends ``" us"``: the host
    overhead case), else ``"ratio"`` (a unitless quotient, or a bubble fraction)."""
    return "us" if ratio_name.endswith(" us") else "ratio"


def chart_pages(rows: list[dict]) -> dict[str, list[list[tuple[str, dict]]]]:
    """``{unit: pages}``, a page a list of ``(label, summary quantiles)`` of at most
    :data:`ROWS_PER_CHART` bars, in the rows' order; units without a row are left out."""
    by_unit: dict[str, list[tuple[str, dict]]] = {}
    for r in rows:
        for name, q in r["ratios"].items():
            by_unit.setdefault(unit(name), []).append((f"{r['case']} {r['label']} {name}", q))
    return {
        u: [items[i : i + ROWS_PER_CHART] for i in range(0, len(items), ROWS_PER_CHART)] for u, items in by_unit.items()
    }


def _bar_chart(plt, items: list[tuple[str, dict]], path: str, xlabel: str, title: str, ratio: bool) -> None:
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(items) + 1.3))
    y = list(range(len(items)))[::-1]
    med = [q["median"] for _, q in items]
    lo = [q["median"] - q["p10"] for _, q in items]
    hi = [q["p90"] - q["median"] for _, q in items]
    colors = ["tab:gray" if q["met"] is None else ("tab:green" if q["met"] else "tab:red") for _, q in items]
    # Dots, not bars: a bar's length from the axis' edge means nothing on a log axis.
    for yi, m, low, high, color in zip(y, med, lo, hi, colors):
        ax.errorbar([m], [yi], xerr=[[low], [high]], fmt="o", ms=5, color=color, ecolor=color, elinewidth=1.2)
    for yi, (_, q) in zip(y, items):
        if q["goal"] is not None:
            ax.plot([q["goal"]] * 2, [yi - 0.4, yi + 0.4], color="k", lw=1.2)
    ax.grid(axis="y", color="0.9", lw=0.6)  # a line per row, to follow a label to its dot
    if ratio:
        ax.axvline(1.0, color="k", ls=":", lw=0.8)
        if all(q["p10"] > 0 for _, q in items):
            ax.set_xscale("log")  # 0.5 and 2 equally far from 1; a 10x outlier leaves the rest readable
    else:
        ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(y, [n for n, _ in items], fontsize=8)
    ax.set_ylim(-0.6, len(items) - 0.4)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # no clipped labels
    plt.close(fig)


def _plots(rows: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for u, pages in chart_pages(rows).items():
        stem, xlabel = UNITS[u]
        for i, items in enumerate(pages):
            paths.append(os.path.join(out_dir, f"{stem}.png" if i == 0 else f"{stem}_{i + 1}.png"))
            title = f"shardkit bench: {'ratios' if u == 'ratio' else 'host microseconds'}"
            title += f" (chart {i + 1} of {len(pages)})" if len(pages) > 1 else ""
            _bar_chart(plt, items, paths[-1], xlabel, title, u == "ratio")
    bw_rows = [r for r in rows if r["busbw_GBps"] and "bytes" in r["params"]]
    if bw_rows:
        fig, ax = plt.subplots(figsize=(10, 6))
        series: dict[str, list] = {}
        for r in bw_rows:
            tag = r["case"] + (
                "" if "direction" not in r["params"] else f" {r['params']['direction']} N={r['params']['heads']}"
            )
            for variant, bw in r["busbw_GBps"].items():
                series.setdefault(f"{tag} {variant}", []).append((r["params"]["bytes"], bw))
        for name, pts in sorted(series.items()):
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                ms=3,
                lw=1,
                label=name,
                ls="-" if "shardkit" in name or "static" in name else "--",
            )
        ax.set_xscale("log", base=2)
        ax.axvline(256 * 1024, color="k", ls=":", lw=0.8)
        ax.set_xlabel("message size per rank, bytes (dotted: ~256 KiB latency/bandwidth crossover)")
        ax.set_ylabel("bus bandwidth GB/s (nccl-tests factors)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "bench_busbw.png"))
        fig.savefig(paths[-1], dpi=DPI, bbox_inches="tight")  # no clipped labels
        plt.close(fig)
    return paths


def write_outputs(records: list[dict], settings: dict, env: dict, out_dir: str, skipped: Sequence[dict] = ()) -> dict:
    """Write ``bench.json``, ``bench.md`` and the plots to ``out_dir``; returns the JSON object.
    ``skipped``: ``{"case", "reason"}`` of the selected cases this world could not run."""
    os.makedirs(out_dir, exist_ok=True)
    rows = [summarize(r) for r in records]
    skipped = list(skipped)
    doc = dict(
        schema=SCHEMA_VERSION, environment=env, settings=settings, summary=rows, records=records, skipped=skipped
    )
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(markdown(rows, env, settings, skipped))
    doc["plots"] = _plots(rows, out_dir)
    return doc
