"""Summaries and outputs of ``shardkit bench``: ``bench.json``, a markdown table and PNG plots.

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

__all__ = ["summarize", "environment", "backend_name", "write_outputs", "markdown", "SCHEMA_VERSION"]

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


def _plots(rows: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    items = [(f"{r['case']} {r['label']} {name}", q) for r in rows for name, q in r["ratios"].items()]
    if items:
        fig, ax = plt.subplots(figsize=(9, 0.28 * len(items) + 1.2))
        y = list(range(len(items)))[::-1]
        med = [q["median"] for _, q in items]
        lo = [q["median"] - q["p10"] for _, q in items]
        hi = [q["p90"] - q["median"] for _, q in items]
        colors = ["tab:gray" if q["met"] is None else ("tab:green" if q["met"] else "tab:red") for _, q in items]
        ax.barh(y, med, xerr=[lo, hi], color=colors, alpha=0.8, error_kw=dict(lw=0.8))
        for yi, (_, q) in zip(y, items):
            if q["goal"] is not None:
                ax.plot([q["goal"]] * 2, [yi - 0.4, yi + 0.4], color="k", lw=1.2)
        ax.axvline(1.0, color="k", ls=":", lw=0.8)
        ax.set_yticks(y, [n for n, _ in items], fontsize=6)
        ax.set_xlabel("median of per-round ratios, bars p10-p90; black tick = goal (green met, red missed)")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "bench_ratios.png"))
        fig.savefig(paths[-1], dpi=130, bbox_inches="tight")  # no clipped labels
        plt.close(fig)
    bw_rows = [r for r in rows if r["busbw_GBps"] and "bytes" in r["params"]]
    if bw_rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
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
        ax.legend(fontsize=5, ncol=2)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "bench_busbw.png"))
        fig.savefig(paths[-1], dpi=130, bbox_inches="tight")  # no clipped labels
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
