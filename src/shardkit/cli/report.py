"""End of ``shardkit train``: the summary table, the parity verdict and the ``--report`` files."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from .._files import atomic_write, finite_json

__all__ = ["print_summary", "print_parity", "write_report", "loss_figure"]

_MIB = 2**20
WINDOW = 5
"""Steps in each window of the summary's loss and gradient-norm means (first and last)."""
_PHASES = {"forward": "fwd", "backward": "bwd"}
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64", "float16": "fp16", "int64": "i64"}


def _layout(result: dict) -> str:
    lay = result["layout"]
    where = f"({lay['nproc']} ranks, {lay['backend']}, {lay['device']})"
    extras = [name.replace("_", " ") for name in ("sequence_parallel", "loss_parallel", "packed") if lay.get(name)]
    if lay.get("schedule"):
        m = lay["microbatches"]
        extras.append(f"{lay['schedule']} with {m} microbatch{'es' if m > 1 else ''}")
    elif lay.get("microbatches", 1) > 1:
        extras.append(f"{lay['microbatches']} accumulated microbatches")
    detail = f" ({', '.join(extras)})" if extras else ""
    return f"{lay['model']}: {lay['parallel']}{detail} {where}"


def _count(n: int) -> str:
    """``1234567`` -> ``"1.23 M (1,234,567)"``."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n:,})"
    return f"{n:,}"


def _windows(name: str, values: list[float], first: int, digits: int, width: int = WINDOW) -> tuple[str, str]:
    """The summary row of a noisy series: the mean of its first and of its last ``width`` steps
    (fewer on a short run: at most half of the steps each, at least one), non-finite steps left
    out. One step's value reads as divergence on a noisy fine-tune where the means fell."""
    if not values:
        return f"{name} (mean)", "-"
    w = max(1, min(width, len(values) // 2))

    def mean(part: list[float]) -> str:
        finite = [v for v in part if math.isfinite(v)]
        return f"{sum(finite) / len(finite):.{digits}f}" if finite else "nan"

    def span(a: int, b: int) -> str:  # 1-based step numbers of values[a:b]
        return f"{first + a + 1}" if a + 1 == b else f"{first + a + 1}-{first + b}"

    n = len(values)
    label = f"{name} (mean of steps {span(0, w)} -> {span(n - w, n)})"
    return label, f"{mean(values[:w])} -> {mean(values[n - w :])}"


def print_summary(result: dict, console: Console) -> None:
    """Run summary and the comm ledger.

    The summary: layout, parameter count, steps, throughput, MFU (against the planner's peak
    figure of the GPU; "n/a" on a CPU), the mean loss and gradient norm of the first and of the
    last :data:`WINDOW` steps, the held-out loss (first and last validation), the fraction of
    (token, slot) pairs over the experts' capacity (``--moe-capacity-factor``), time, peak memory
    per rank, saved activations.
    """
    losses = result["losses"]
    table = Table(title="shardkit train", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("layout", _layout(result))
    if result.get("parameters") is not None:
        table.add_row("parameters", _count(result["parameters"]))
    table.add_row("steps", str(len(losses)))
    if "pixels_per_s" in result:
        table.add_row("pixels/s", f"{result['pixels_per_s']:,.0f}")
    else:
        table.add_row("tokens/s", f"{result['tokens_per_s']:,.0f}")
    if "mfu_basis" in result:
        mfu = result.get("mfu")
        table.add_row("MFU", result["mfu_basis"] if mfu is None else f"{100 * mfu:.1f}% {result['mfu_basis']}")
    first = result.get("first_step", 0)
    table.add_row(*_windows("loss", losses, first, 5))
    evals = result.get("eval_losses") or []
    if evals:
        shown = evals if len(evals) <= 2 else [evals[0], evals[-1]]
        table.add_row("held-out loss", " -> ".join(f"{loss:.5f} (step {step})" for step, loss in shown))
    norms = result.get("grad_norms")
    if norms:
        table.add_row(*_windows("grad norm", norms, first, 4))
    cfg = result.get("config", {})
    if cfg.get("moe_capacity_factor") is not None and result.get("moe_load_counts"):
        # each step's per-layer rows: the expert loads, then the dropped (token, slot) pairs
        rows = [row for step in result["moe_load_counts"] for row in step]
        dropped, routed = sum(r[-1] for r in rows), sum(sum(r[:-1]) for r in rows)
        how = f"capacity factor {cfg['moe_capacity_factor']:g}, {cfg.get('moe_drop_policy', 'probs')}"
        table.add_row("dropped (token, slot) pairs", f"{100 * dropped / max(routed, 1):.2f}% ({how})")
    table.add_row("train time", f"{result['timings_s']['train']:.2f} s (setup {result['timings_s']['setup']:.2f} s)")
    mem = ", ".join(f"r{r}: {b / _MIB:.0f}" for r, b in enumerate(result["peak_memory_bytes"]))
    table.add_row(f"peak memory MiB ({result['memory_kind']})", mem)
    saved = result.get("saved_activation_bytes") or []
    if any(b is not None for b in saved):
        ac = result.get("config", {}).get("ac", "none")
        kept = ", ".join(f"r{r}: {b / _MIB:.2f}" for r, b in enumerate(saved) if b is not None)
        table.add_row(f"saved activations MiB (step 1, --ac {ac})", kept)
    console.print(table)

    # By mesh axis, in mesh order. Fits 80 columns: c10d op without "_single", forward/backward
    # as fwd/bwd in api names (report.json keeps the full names and the group size).
    ledger = Table(title="comm ledger by axis (rank 0)", box=box.SIMPLE_HEAD, pad_edge=False)
    for name in ("axis", "op", "api", "phase", "dtype", "calls", "MiB out", "MiB in"):
        left = name in ("axis", "op", "api", "phase", "dtype")
        ledger.add_column(name, justify="left" if left else "right", no_wrap=True)
    for row in result["ledger"]:
        ledger.add_row(
            row.get("axis", "-"),
            row["op"].removesuffix("_single"),
            row["api"].replace("forward", "fwd").replace("backward", "bwd"),
            _PHASES.get(row["phase"], row["phase"]),
            _DTYPES.get(row.get("dtype", "-"), row.get("dtype", "-")),
            str(row["count"]),
            f"{row['bytes_sent'] / _MIB:.2f}",
            f"{row['bytes_received'] / _MIB:.2f}",
        )
    console.print(ledger)


def print_parity(parity: dict, console: Console) -> None:
    """The ``--verify`` verdict with the largest differences."""
    verdict = "[bold green]PASSED[/]" if parity["passed"] else "[bold red]FAILED[/]"
    console.print(
        f"verify ({parity['dtype']}, tolerance {parity['tolerance']:.0e}): {verdict}  "
        f"max loss rel diff {parity['max_loss_rel_diff']:.3e}, "
        f"max param rel diff {parity['max_param_rel_diff']:.3e}"
    )
    diffs = parity["loss_rel_diff"]
    if diffs:
        step = max(range(len(diffs)), key=diffs.__getitem__)
        console.print(f"  largest loss difference at step {step}: {diffs[step]:.3e}")
    for name, d in parity["worst_params"]:
        console.print(f"  {d:.3e}  {name}")
    if parity["missing_params"]:
        console.print(f"  parameters in only one run: {parity['missing_params']}")


def write_report(result: dict, folder: str | os.PathLike) -> list[Path]:
    """Write ``report.json`` (and ``loss.png`` when matplotlib is installed) into ``folder``.

    The folder is created if needed; only these two names are written (replaced atomically),
    nothing else in it is touched. A non-finite number (a skipped step's NaN loss) is written as
    ``null`` and its place listed in ``nonfinite`` (``"losses[3]"``): JSON has no NaN.

    Returns:
        The paths written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "report.json"]

    finite, nonfinite = finite_json(result)  # NaN / inf are no JSON: null, their places in "nonfinite"
    if nonfinite:
        finite["nonfinite"] = nonfinite

    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(finite, f, indent=2, default=str, allow_nan=False)
            f.write("\n")

    atomic_write(written[0], dump)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return written
    written.append(folder / "loss.png")
    atomic_write(written[1], lambda tmp: _plot(result, tmp))
    return written


def loss_figure(result: dict):
    """The ``loss.png`` figure of a run: a :class:`matplotlib.figure.Figure` (not drawn yet).

    Top panel: the loss per step (and the ``--verify`` reference's, dashed; the held-out loss
    at the steps validated, ``--eval-every``, as squares). With a reference, a
    second panel: ``|parallel - reference|`` per step on a log scale (a step where the two are
    bitwise equal has no point there; the panel says so when every step is). Steps are the
    1-based step numbers (a resumed run starts at its ``first_step + 1``), on integer ticks; the
    title names the model and the layout.
    """
    # A bare Figure renders with Agg without touching pyplot's global backend or figure list.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    losses, ref = result["losses"], result.get("reference_losses") or []
    first = result.get("first_step", 0)
    steps = list(range(first + 1, first + len(losses) + 1))
    fig = Figure(figsize=(6.4, 5.6 if ref else 4.0))
    axes = fig.subplots(2 if ref else 1, 1, sharex=True, squeeze=False, height_ratios=[2, 1] if ref else None)[:, 0]
    ax = axes[0]
    ax.plot(steps, losses, marker=".", label="parallel")
    if ref:
        ax.plot(steps[: len(ref)], ref, "--", marker="x", label="reference (1 process, --verify)")
        diff = axes[1]
        pairs = [(s, abs(a - b)) for s, a, b in zip(steps, losses, ref)]
        shown = [(s, d) for s, d in pairs if d > 0]
        diff.set_yscale("log")
        if shown:  # log scale: an exact match has no point (NaN: a gap in the line, not a bridge over it)
            diff.plot(
                [s for s, _ in pairs], [d if d > 0 else float("nan") for _, d in pairs], marker=".", color="tab:red"
            )
        if len(shown) < len(pairs):
            note = "equal at every step" if not shown else f"equal at {len(pairs) - len(shown)} of {len(pairs)} steps"
            diff.text(0.02, 0.9, f"bitwise {note}", transform=diff.transAxes, fontsize=8, va="top")
        diff.set_ylabel("|parallel - reference|")
        diff.grid(True, which="major", alpha=0.3)
    evals = result.get("eval_losses") or []
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], "s-", color="tab:green", label="held-out (--eval-every)")
    ax.set_ylabel("loss")
    ax.set_title(_layout(result), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def _plot(result: dict, path: str) -> None:
    loss_figure(result).savefig(path, format="png", bbox_inches="tight")
