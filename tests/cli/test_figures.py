"""The plan and bench figures keep every label inside the image (issue 23, item 7)."""

from types import SimpleNamespace

import pytest

from shardkit.bench.report import DPI, _plots, chart_pages
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
    assert _png_width(path) > 10 * DPI  # figsize 10 in: the label would be clipped


def _png_height(path) -> int:
    return int.from_bytes(open(path, "rb").read(24)[20:24], "big")


def _row(case: str, names: list[str], median: float) -> dict:
    q = {"median": median, "p10": 0.9 * median, "p90": 1.1 * median, "goal": None, "met": None}
    return {"case": case, "label": "x", "ratios": {n: dict(q) for n in names}, "busbw_GBps": {}, "params": {}}


def test_one_chart_per_unit_and_no_chart_taller_than_a_screen(tmp_path):
    """Issue 32, item 3: the microsecond rows of the host-overhead case squashed every ratio
    into a sliver of one 9388 px tall chart."""
    rows = [_row("host_overhead", ["shardkit-bare us", "ledger cost us"], 40.0), _row("ring", ["a/b"], 0.9)]
    rows += [_row(f"case{i}", [f"r{j}" for j in range(10)], 1.0 + i / 10) for i in range(11)]  # 111 ratio rows
    pages = chart_pages(rows)
    assert [len(p) for p in pages["us"]] == [2] and [len(p) for p in pages["ratio"]] == [45, 45, 21]
    assert all(name.endswith(" us") for name, _ in pages["us"][0])
    assert not any(name.endswith(" us") for page in pages["ratio"] for name, _ in page)
    paths = _plots(rows, str(tmp_path))
    names = [p.rsplit("/", 1)[-1] for p in paths]
    assert names == ["bench_us.png", "bench_ratios.png", "bench_ratios_2.png", "bench_ratios_3.png"]
    for path in paths:
        assert 100 < _png_height(path) <= 1600, (path, _png_height(path))
        assert _png_width(path) <= 1600, (path, _png_width(path))
