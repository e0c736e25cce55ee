"""The plan and bench figures keep every label inside the image (issue 23, item 7)."""

from types import SimpleNamespace

import pytest

from shardkit.bench.report import _plots
from shardkit.cli.plan import _plot

pytest.importorskip("matplotlib")


def _png_width(path) -> int:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big")


def test_a_long_layout_name_widens_the_plan_figure(tmp_path):
    long = " x ".join(f"axis{i}=2" for i in range(30))  # far wider than the 10-inch figure
    estimates = [
        SimpleNamespace(dims=SimpleNamespace(describe=lambda name=name: name), compute_s=1.0, bubble=0.1, comm_s=0.2)
        for name in ("tp=8", long)
    ]
    path = tmp_path / "plan.png"
    _plot(str(path), estimates, given=1)
    assert _png_width(path) > 10 * 100  # the figure's width at matplotlib's default 100 dpi: clipped


def test_a_long_bench_label_widens_the_ratio_figure(tmp_path):
    q = {"median": 1.0, "p10": 0.9, "p90": 1.1, "goal": None, "met": None}
    rows = [{"case": "c" * 400, "label": "x", "ratios": {"r": q}, "busbw_GBps": {}, "params": {}}]
    (path,) = _plots(rows, str(tmp_path))
    assert _png_width(path) > 9 * 130  # figsize 9 in at dpi 130: the label would be clipped
