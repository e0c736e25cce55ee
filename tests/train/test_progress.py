"""Rank 0's progress when stdout is not a terminal: a plain line every ``--log-every`` steps
(mean loss of the window, lr, rate) and set-up notes; a bar only on a terminal."""

import io
import math

from shardkit.train.progress import (
    LogLines,
    TrainProgress,
    default_log_every,
    format_eta,
    make_progress,
    setup_note,
)


def test_a_line_every_n_steps_with_the_window_mean_and_the_last_step():
    out = io.StringIO()
    with LogLines(steps=5, tokens_per_step=64, every=2, out=out) as log:
        for step, loss in enumerate([4.0, 2.0, 3.0, float("nan"), 1.0]):
            log.update(step, loss, lr=1e-3)
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[:3] for line in lines] == [
        ["step 2/5", "loss 3.0000 (mean of 2)", "lr 1.00e-03"],
        ["step 4/5", "loss 3.0000 (mean of 2)", "lr 1.00e-03"],  # the non-finite step is left out of the mean
        ["step 5/5", "loss 1.0000 (mean of 1)", "lr 1.00e-03"],  # the last step always
    ]
    assert all(line.split("  ")[3].endswith(" tok/s") for line in lines)
    # steps left: an ETA from the second step on, none on the last line
    assert "  eta " in lines[0] and "  eta " in lines[1] and "eta" not in lines[2]


def test_the_eta_is_the_steps_left_times_the_mean_step_after_the_first(monkeypatch):
    clock = iter([0.0, 100.0, 110.0, 120.0, 130.0, 140.0])  # a 100 s first step (warm-up), then 10 s each
    monkeypatch.setattr("shardkit.train.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    with LogLines(steps=400, tokens_per_step=8, every=2, out=out) as log:
        for step in range(4):
            log.update(step, 1.0)
    assert [line.rsplit("  ", 1)[1] for line in out.getvalue().splitlines()] == ["eta 1h06m", "eta 1h06m"]
    assert [format_eta(s) for s in (0.4, 59, 60, 185, 3599, 3600, 7620)] == [
        "0s",
        "59s",
        "1m00s",
        "3m05s",
        "59m59s",
        "1h00m",
        "2h07m",
    ]


def test_notes_print_a_line_of_their_own():
    out = io.StringIO()
    with LogLines(steps=2, tokens_per_step=8, every=1, out=out) as log:
        log.update(0, 1.0)
        log.note("saved step 1: /x/step_00000001")
    assert out.getvalue().splitlines()[1] == "saved step 1: /x/step_00000001"


def test_a_resumed_run_logs_at_the_same_step_numbers():
    out = io.StringIO()
    with LogLines(steps=6, tokens_per_step=8, every=2, unit="px", out=out) as log:
        for step in range(3, 6):  # resumed at step 3
            log.update(step, float(step))
    assert [line.split("  ")[:2] for line in out.getvalue().splitlines()] == [
        ["step 4/6", "loss 3.0000 (mean of 1)"],
        ["step 6/6", "loss 4.5000 (mean of 2)"],
    ]
    assert "lr" not in out.getvalue() and out.getvalue().splitlines()[0].endswith(" px/s")


def test_only_non_finite_losses_print_nan():
    out = io.StringIO()
    LogLines(steps=1, tokens_per_step=1, every=1, out=out).update(0, math.inf)
    assert out.getvalue().startswith("step 1/1  loss nan (mean of 1)")


def test_default_every_and_the_choice_by_terminal(monkeypatch):
    assert [default_log_every(n) for n in (1, 20, 21, 1000)] == [1, 1, 10, 10]
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert isinstance(make_progress(10, 64, 2), LogLines)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert isinstance(make_progress(10, 64, 2), TrainProgress)


def test_setup_note_says_the_stage_and_the_seconds():
    out = io.StringIO()
    setup_note("building the model (llama)", 0.0, out)
    text = out.getvalue()
    assert text.startswith("shardkit train: [") and text.endswith(" s] building the model (llama)\n")


def test_a_validation_shows_on_the_next_line():
    out = io.StringIO()
    with LogLines(steps=4, tokens_per_step=8, every=2, out=out) as log:
        log.update(0, 3.0, 1e-3, eval_loss=2.5)  # validated after step 1, between two lines
        log.update(1, 3.0, 1e-3)
        log.update(2, 3.0, 1e-3)
        log.update(3, 3.0, 1e-3)
    first, second = out.getvalue().splitlines()
    assert "  held-out 2.5000 (step 1)" in first and "held-out" not in second
