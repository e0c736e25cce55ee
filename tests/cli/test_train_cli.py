"""``shardkit train``: configuration, data, parity bookkeeping and reports in-process; one up-front
failure as a subprocess (the real run: test_train_run.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.limits import patient
from shardkit import ShardkitError
from shardkit.cli.main import build_parser
from shardkit.cli.report import loss_figure, write_report
from shardkit.cli.train import config_from_args, finish
from shardkit.train.config import load_toml, merge_config, parallel_dims, validate_config
from shardkit.train.data import BatchSampler, corpus_files, load_tokens, stdlib_files
from shardkit.train.lm_task import LMTask, causal_lm_loss, shifted_labels
from shardkit.train.verify import compare_runs


def _args(*argv):
    return build_parser().parse_args(["train", *argv])


# --- configuration -------------------------------------------------------------------------


def test_defaults_resolve_dp():
    cfg = config_from_args(_args())
    assert (cfg.nproc, cfg.tp, cfg.dp_replicate, cfg.steps, cfg.seq_len, cfg.batch_size) == (4, 2, 2, 20, 128, 8)
    assert cfg.dtype == "float32" and cfg.verify is False and cfg.report is None


def test_toml_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 7\nseq_len = 64\ndtype = "float64"\nverify = true\nlr = 1\n')
    cfg = config_from_args(_args("--config", str(path), "--steps", "3", "--no-verify"))
    assert (cfg.steps, cfg.seq_len, cfg.dtype, cfg.verify, cfg.lr) == (3, 64, "float64", False, 1)
    assert cfg.config == str(path)


@pytest.mark.parametrize(
    "text,match",
    [
        ("stpes = 3\n", "unknown key 'stpes'"),
        ('steps = "3"\n', "steps .* must be int"),
        ("verify = 1\n", "verify .* must be bool"),
        ("steps = \n", "not valid TOML"),
    ],
)
def test_bad_toml(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ShardkitError, match=match):
        load_toml(path)


def test_missing_toml(tmp_path):
    with pytest.raises(ShardkitError, match="cannot read"):
        load_toml(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp=3), "tp=3 x spatial=1 x dp_shard=1 = 3 ranks must divide --nproc 4"),
        (dict(tp=2, dp=1, nproc=4), "dp_replicate=1 = 2 ranks, but --nproc is 4"),
        (dict(dp=2, dp_replicate=1), "--dp is an alias, give one"),
        (dict(batch_size=5), "--batch-size 5 .* divisible by dp=2"),
        (dict(dp_shard=2, tp=1, batch_size=6), "--batch-size 6 .* divisible by dp=4"),
        (dict(seq_len=1), "--seq-len must be >= 2"),
        (dict(heads=3), "--hidden-size 64 must be divisible by --heads 3"),
        (dict(pp=2, tp=2, dp=2, nproc=4), "dp_replicate=2 = 8 ranks, but --nproc is 4"),
        (dict(pp_tp="2,1"), "pp_tp=2,1 .sum 3. ranks must divide --nproc 4"),
        (dict(pp_tp="2,1,1", tp=2), "--tp 2 with --pp-tp 2,1,1: give the stage tp sizes once"),
        (dict(pp_tp="2,1,1", pp=2), "--pp 2 but --pp-tp 2,1,1 lists 3 stages"),
        (dict(pp_tp="2"), "--pp-tp must list the tp size .* of at least 2 pipeline stages"),
        (dict(pp_tp="2,x"), "--pp-tp must list"),
        (dict(pp_tp="2,0"), "--pp-tp must list"),
        (dict(pp_tp="2,1,1", dp=2, nproc=4), "dp_replicate=2 = 8 ranks, but --nproc is 4"),
        (dict(pp_tp="2,1,1", cp_ring=2, layers=3), "pp_tp=.* composes with dp_replicate only"),
        (dict(pp=3), "pp=3 .* = 3 ranks must divide --nproc 4"),
        (dict(pp=4, layers=2), "--pp 4: .*2 decoder layers cannot fill 4 pipeline stages"),
        (dict(pp=2, microbatches=3), "--batch-size 8 .* divisible by dp=2 x microbatches=3"),
        (dict(pp=2, schedule="zb"), "--schedule must be one of 1f1b, gpipe"),
        (dict(model="llama", ep=2), "--ep 2 needs a mixture-of-experts model"),
        # ep=4 over tp=2 x dp_replicate=2 is experts over both replicas (issue 33 item 4); 8 is too many
        (dict(model="moe", ep=8), "ep=8 must divide dp_shard x cp_ring x cp_ulysses x tp = 2, or be a multiple"),
        (dict(model="moe", ep=3, tp=1, dp_shard=4), "ep=3 must divide .* = 4"),
        (
            dict(model="moe", tp=4, nproc=8, heads=2, hidden_size=64, kv_heads=1),
            "--tp 4: 2 query heads cannot be split over tp=4",
        ),
        (dict(model="mla", experts=0), "--experts must be >= 1"),
        (dict(cp_ring=2, tp=2, nproc=2), "cp=2 x tp=2 .* = 4 ranks must divide --nproc 2"),
        (dict(cp_ulysses=2, cp_ring=2, dp=2, nproc=4), "dp_replicate=2 = 8 ranks, but --nproc is 4"),
        (dict(cp_ulysses=0), "--cp-ulysses must be >= 1"),
        (dict(cp_ring=4, seq_len=3), "--seq-len 3 .*: every cp rank needs at least one token"),
        (dict(cp_ring=2, cp_ulysses=2, seq_len=3), "--seq-len 3 .*: every cp rank needs at least one token"),
        (dict(cp_ulysses=4, seq_len=3), "--seq-len 3 .*: every cp rank needs at least one token"),
        (dict(cp_ring=2, tp=4, nproc=8), "--tp 4 with context parallelism: tp must divide"),
        (dict(cp_ring=2, packed=True), "--packed with context parallelism: every microbatch must be one row"),
        (dict(max_norm=-1.0), "--max-norm must be a finite number >= 0"),
        (dict(pp_tp="2,1,1", sequence_parallel=True, layers=3), "--sequence-parallel with --pp-tp"),
        (dict(dp_shard=0), "--dp-shard must be >= 1"),
        (dict(report="/etc/passwd/out"), "--report /etc/passwd/out: /etc/passwd exists and is not a directory"),
        (dict(checkpoint_dir="/etc/passwd"), "--checkpoint-dir /etc/passwd: /etc/passwd exists and is not a directory"),
    ],
)
def test_invalid_layouts(kwargs, match):
    with pytest.raises(ShardkitError, match=match):
        validate_config(merge_config({}, kwargs))


@pytest.mark.parametrize(
    "flag", ["--steps", "--eval-every", "--log-every", "--save-every", "--keep", "--eval-batches", "--skip-nonfinite"]
)
def test_step_counts_are_bounded_like_sizes(flag, tmp_path):
    # issue 31 item 6: --steps 2**31 and the like were accepted (a run that never ends, or an
    # overflow deep in a worker); refused before launch, naming the flag
    extra = ["--checkpoint-dir", str(tmp_path / "ck")] if flag in ("--keep", "--save-every") else []
    with pytest.raises(ShardkitError, match=rf"{flag} must be <= 2\*\*31 - 1, got 2147483648"):
        config_from_args(_args(flag, str(2**31), *extra))
    assert config_from_args(_args("--steps", str(2**31 - 1))).steps == 2**31 - 1


@pytest.mark.parametrize("value", ["0.001", "0.5"])
def test_a_timeout_shorter_than_a_process_group_start_is_refused(value):
    # issue 31 item 5: --timeout 0.001 was accepted, then every rank failed with a raw "Wait timeout"
    with pytest.raises(ShardkitError, match=rf"--timeout must be .* in \[1, 86400\], got {value} \(a process group"):
        config_from_args(_args("--timeout", value))
    assert config_from_args(_args("--timeout", "1")).timeout == 1


def test_pipeline_layout_defaults():
    cfg = config_from_args(_args("--pp", "2", "--microbatches", "2", "--schedule", "gpipe"))
    assert (cfg.pp, cfg.tp, cfg.dp_replicate, cfg.microbatches, cfg.schedule) == (2, 1, 2, 2, "gpipe")
    assert config_from_args(_args("--pp", "4", "--layers", "4")).dp_replicate == 1


def test_pipeline_tp_layouts():
    cfg = config_from_args(_args("--pp", "2", "--tp", "2", "--microbatches", "2"))
    assert (cfg.pp, cfg.tp, cfg.dp_replicate, cfg.stage_tp_sizes) == (2, 2, 1, (2, 2))
    cfg = validate_config(merge_config({"pp_tp": "2, 1,1"}, {"layers": 3}))  # from a TOML file
    assert (cfg.pp, cfg.pp_tp, cfg.stage_tp_sizes, cfg.dp_replicate, cfg.nproc) == (3, "2,1,1", (2, 1, 1), 1, 4)
    cfg = validate_config(merge_config({}, dict(pp_tp="1,2", nproc=6, layers=2)))
    assert (cfg.pp, cfg.dp_replicate) == (2, 2)


def test_cp_layouts():
    cfg = config_from_args(_args("--cp-ulysses", "2", "--cp-ring", "2"))  # tp defaults to 1 with cp
    assert (cfg.tp, cfg.cp_ring, cfg.cp_ulysses, cfg.dp_replicate) == (1, 2, 2, 1)
    cfg = config_from_args(_args("--cp-ring", "2", "--tp", "2", "--nproc", "8"))
    assert (cfg.tp, cfg.cp_size, cfg.dp_replicate) == (2, 2, 2)
    assert validate_config(merge_config({}, dict(cp_ring=4, seq_len=4))).dp_replicate == 1  # one token per ring rank
    assert validate_config(merge_config({}, dict(cp_ring=2, cp_ulysses=2, seq_len=4))).dp_replicate == 1


def test_layouts_that_used_to_be_refused_now_compose():
    # cp x pp, cp with MoE, cp x loss-parallel, gradient accumulation without pp, ep independent
    # of tp, loss-parallel x pp, conv-ae x dp: each is one ParallelDims of the one trainer.
    for kwargs in (
        dict(cp_ring=2, pp=2),
        dict(cp_ring=2, model="moe"),
        dict(cp_ring=2, loss_parallel=True),
        dict(microbatches=2),
        dict(model="moe", ep=4, tp=1, dp_shard=4),
        dict(pp=2, tp=2, loss_parallel=True),
        dict(model="conv-ae", spatial=2, dp=2),
        dict(model="qwen3", pp=2),
        dict(tp=4),
        dict(pp=2, tp=4, nproc=8),
        dict(model="moe", ep=4),  # experts over tp=2 x both dp replicas (issue 33 item 4)
        dict(model="moe", ep=2, tp=1, zero=1),  # experts on pairs of ZeRO-1 replicas
        dict(zero=2),  # ZeRO-2 over the dp replicas beside tp=2
    ):
        cfg = validate_config(merge_config({}, kwargs))
        assert cfg.nproc == kwargs.get("nproc", 4), kwargs


def test_fsdp_and_hsdp_layouts():
    cfg = validate_config(merge_config({}, dict(dp_shard=2)))
    assert (cfg.tp, cfg.dp_shard, cfg.dp_replicate) == (2, 2, 1)
    cfg = validate_config(merge_config({}, dict(dp_shard=2, tp=1)))
    assert (cfg.dp_shard, cfg.dp_replicate) == (2, 2)  # HSDP: 2 replicas of 2 shards
    assert parallel_dims(cfg).describe() == "dp_replicate=2 x dp_shard=2"


def test_packed_sampler_windows_and_documents():
    from shardkit.train.lm_task import PackedSampler

    tokens = torch.arange(100, dtype=torch.int64) % 256
    sizes = [30, 5, 1, 64]  # files start at 30, 35, 36
    plain, packed = BatchSampler(tokens, 16, 4, seed=1), PackedSampler(tokens, 16, 4, 1, sizes)
    for _ in range(5):
        ids, cus = packed.next_batch()
        assert torch.equal(ids, plain.next_batch())  # the same windows as the reference sampler
        for row, cu in zip(ids, cus):
            a = int(row[0])
            assert cu == (0, *[s - a for s in (30, 35, 36) if a < s < a + 16], 16)


def test_torchrun_world_size():
    assert validate_config(merge_config({}, {}), world_size=8).dp_replicate == 4
    with pytest.raises(ShardkitError, match="does not match the torchrun world size 8"):
        validate_config(merge_config({}, dict(nproc=2, tp=1)), world_size=8)


# --- data ----------------------------------------------------------------------------------


def test_corpus_folder_sorted_and_bytes(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_bytes("é".encode())
    files = corpus_files(str(tmp_path))
    assert [f.name for f in files] == ["a.txt", "b.txt", "c.txt"]
    tokens = load_tokens(files)
    assert bytes(tokens.tolist()) == "hello worldé".encode() and tokens.dtype == torch.uint8
    assert bytes(load_tokens(files, max_bytes=4).tolist()) == b"hell"
    with pytest.raises(ShardkitError, match="neither a file nor a folder"):
        corpus_files(str(tmp_path / "missing"))


def test_stdlib_corpus():
    files = stdlib_files()
    names = {f.name for f in files}
    assert "os.py" in names and files == sorted(files)
    assert not any("site-packages" in f.parts for f in files)


def test_sampler_is_deterministic_and_dp_rows_cover_the_batch():
    tokens = torch.arange(1000, dtype=torch.int64) % 256
    a, b = BatchSampler(tokens, 16, 4, seed=3), BatchSampler(tokens, 16, 4, seed=3)
    batches = [a.next_batch() for _ in range(3)]
    assert all(torch.equal(x, b.next_batch()) for x in batches)
    assert not torch.equal(batches[0], batches[1])
    x = batches[0]
    assert x.shape == (4, 16) and x.dtype == torch.int64
    assert bool(((x[:, 1:] - x[:, :-1]) % 256 == 1).all())  # each row is a contiguous window
    task = LMTask(a, torch.device("cpu"))
    # dp ranks x microbatches cover the global batch once, in order
    parts = [mb.ids for d in range(2) for mb in task.microbatches((x, None), d, 2, 2)]
    assert [p.shape[0] for p in parts] == [1, 1, 1, 1] and torch.equal(torch.cat(parts), x)
    assert task.count((x, None)) == 4 * 15
    with pytest.raises(ShardkitError, match="fewer than --seq-len"):
        BatchSampler(tokens[:10], 16, 4, seed=0)


# --- loss, parity, report ------------------------------------------------------------------


def test_causal_lm_loss_matches_hf_and_keeps_float64():
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 7), generator=gen)
    ours = causal_lm_loss(logits, ids)
    assert ours.dtype == torch.float64
    assert torch.allclose(ours.float(), ForCausalLMLoss(logits, ids, vocab_size=11), rtol=1e-6)
    assert causal_lm_loss(logits.bfloat16(), ids).dtype == torch.float32


def test_shifted_labels_never_cross_documents():
    ids = torch.arange(8).view(1, 8)
    assert shifted_labels(ids).tolist() == [[1, 2, 3, 4, 5, 6, 7, -100]]
    assert shifted_labels(ids, [(0, 3, 8)]).tolist() == [[1, 2, -100, 4, 5, 6, 7, -100]]


def test_compare_runs():
    params = {"w": torch.ones(3), "b": torch.zeros(2)}
    close = {"w": torch.ones(3) * (1 + 1e-6), "b": torch.zeros(2)}
    ok = compare_runs([2.0, 1.0], [2.0, 1.0 + 1e-6], close, params, "float32")
    assert ok["passed"] and ok["max_loss_rel_diff"] == pytest.approx(1e-6, rel=1e-3)
    assert ok["worst_params"][0][0] == "w"
    bad = compare_runs([2.0, 1.0], [2.0, 1.0], {"w": torch.ones(3) * 2, "b": torch.zeros(2)}, params, "float64")
    assert not bad["passed"] and bad["max_param_rel_diff"] == pytest.approx(1.0)
    assert not compare_runs([1.0], [1.0], {"w": torch.ones(3)}, params, "float32")["passed"]  # missing "b"


def test_write_report_keeps_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = {
        "layout": {"nproc": 1, "model": "llama", "parallel": "single process", "backend": "gloo", "device": "cpu"},
        "losses": [3.0, 2.0],
        "reference_losses": [3.0, 2.0],
    }
    paths = write_report(result, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["losses"] == [3.0, 2.0]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG" and len(paths) == 2
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "notes.txt", "report.json"]  # no temp files


def _strict_json(text: str):
    """``json.loads`` refusing the NaN / Infinity tokens Python's json writes by default (not JSON)."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_report_json_writes_non_finite_numbers_as_null_with_a_flag(tmp_path):
    # issue 31 item 6: a skipped step's NaN loss reached report.json as the token NaN / Infinity
    nan, inf = float("nan"), float("inf")
    result = {
        "layout": {"nproc": 1, "model": "llama", "parallel": "single process", "backend": "gloo", "device": "cpu"},
        "losses": [3.0, nan, 2.0],
        "grad_norms": [1.0, inf, 0.5],
        "parity": {"max_loss_rel_diff": -inf},
    }
    write_report(result, tmp_path)
    report = _strict_json((tmp_path / "report.json").read_text())
    assert report["losses"] == [3.0, None, 2.0] and report["grad_norms"] == [1.0, None, 0.5]
    assert report["nonfinite"] == ["losses[1]", "grad_norms[1]", "parity.max_loss_rel_diff"]
    assert result["losses"][1] != result["losses"][1]  # the caller's dict is unchanged (NaN)


def _figure_result(losses, reference=None, first_step=0):
    return {
        "layout": {
            "nproc": 4,
            "model": "llama",
            "parallel": "dp_replicate=2 x tp=2",
            "backend": "gloo",
            "device": "cpu",
            "sequence_parallel": True,
        },
        "losses": losses,
        "reference_losses": reference,
        "first_step": first_step,
    }


def _ticks(ax):
    lo, hi = ax.get_xlim()
    return [t for t in ax.get_xticks() if lo <= t <= hi]


def test_loss_figure_with_the_parity_panel(tmp_path):
    losses = [3.0, 2.5, 2.25, 2.0, 1.9, 1.8, 1.75]
    reference = [3.0, 2.5 + 1e-6, 2.25 - 1e-5, 2.0, 1.9 + 1e-7, 1.8, 1.75 + 2e-6]
    fig = loss_figure(_figure_result(losses, reference, first_step=3))
    fig.savefig(tmp_path / "loss.png")  # renders (tick positions final)
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    top, bottom = fig.axes
    assert len(fig.axes) == 2
    assert top.get_title() == "llama: dp_replicate=2 x tp=2 (sequence parallel) (4 ranks, gloo, cpu)"
    assert (top.get_ylabel(), bottom.get_ylabel(), bottom.get_xlabel()) == ("loss", "|parallel - reference|", "step")
    assert bottom.get_yscale() == "log"
    ticks = _ticks(bottom)
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)
    # steps 4..10 (resumed at 3); the difference panel holds the steps that differ, exactly
    assert list(top.lines[0].get_xdata()) == list(range(4, 11)) and list(top.lines[1].get_ydata()) == reference
    (diff_line,) = bottom.lines
    expected = [(s, abs(a - b)) for s, a, b in zip(range(4, 11), losses, reference) if a != b]
    points = list(zip(diff_line.get_xdata(), diff_line.get_ydata()))
    assert [(s, d) for s, d in points if d == d] == expected  # equal steps are NaN gaps
    assert len(points) == 7
    assert [t.get_text() for t in bottom.texts] == ["bitwise equal at 3 of 7 steps"]


def test_loss_figure_without_reference_is_one_panel():
    fig = loss_figure(_figure_result([2.0, 1.5, 1.25]))
    fig.savefig(os.devnull, format="png")
    (ax,) = fig.axes
    assert ax.get_title().startswith("llama: dp_replicate=2 x tp=2") and ax.get_xlabel() == "step"
    assert all(float(t).is_integer() for t in _ticks(ax)) and len(ax.lines) == 1


def test_loss_figure_bitwise_equal_run():
    fig = loss_figure(_figure_result([2.0, 1.5], [2.0, 1.5]))
    fig.savefig(os.devnull, format="png")
    assert not fig.axes[1].lines and [t.get_text() for t in fig.axes[1].texts] == ["bitwise equal at every step"]


def _result(passed):
    params = {"w": torch.ones(3)}
    parity = compare_runs([2.0], [2.0], {"w": torch.ones(3) * (1 if passed else 2)}, params, "float32")
    return {
        "layout": {
            "nproc": 4,
            "model": "llama",
            "parallel": "dp_replicate=2 x tp=2",
            "backend": "gloo",
            "device": "cpu",
        },
        "losses": [2.0],
        "reference_losses": [2.0],
        "tokens_per_s": 1000.0,
        "timings_s": {"setup": 1.0, "train": 2.0},
        "peak_memory_bytes": [2**20] * 4,
        "memory_kind": "max RSS",
        "ledger": [
            {
                "op": "all_reduce",
                "api": "ddp",
                "phase": "backward",
                "group_size": 2,
                "count": 1,
                "bytes_sent": 8,
                "bytes_received": 8,
            }
        ],
        "parity": parity,
    }


def test_finish_exit_code_and_largest_differences(tmp_path, capsys):
    cfg = config_from_args(_args("--report", str(tmp_path)))
    assert finish(_result(passed=True), cfg) == 0
    assert "PASSED" in capsys.readouterr().out
    assert finish(_result(passed=False), cfg) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "1.000e+00  w" in out
    assert json.loads((tmp_path / "report.json").read_text())["parity"]["passed"] is False


def test_finish_names_the_save_hf_directory(tmp_path, capsys):
    cfg = config_from_args(_args("--save-hf", str(tmp_path / "hf")))
    assert finish(_result(passed=True), cfg) == 0
    assert f"Hugging Face model (--save-hf, step 20): {tmp_path / 'hf'}" in capsys.readouterr().out  # the step


def _report_held_by(folder, pid: int) -> None:
    """``folder``'s report lock, as a job in progress (process ``pid``) holds it."""
    import socket

    from shardkit.checkpoint.lock import _start_time

    folder.mkdir(exist_ok=True)
    holder = {"run_id": "firstjob0001", "host": socket.gethostname(), "pid": pid, "start": _start_time(pid)}
    (folder / ".report.lock").write_text(json.dumps(holder))  # checkpoint.lock.REPORT_LOCK


def test_a_second_job_on_one_report_dir_is_refused_before_launch(tmp_path, capsys):
    # issue 31 item 5: two jobs on one --report interleaved metrics.jsonl and overwrote report.json
    from shardkit.cli.main import main

    first = subprocess.Popen(["sleep", "120"])
    try:
        _report_held_by(tmp_path, first.pid)
        argv = ["train", "--report", str(tmp_path), "--steps", "1", "--tp", "1", "--nproc", "1", "--seq-len", "16"]
        assert main([*argv, "--batch-size", "2"]) == 2
        err = capsys.readouterr().err
        assert (
            f"shardkit train --report: the report directory {tmp_path} is in use by run firstjob0001 "
            f"(pid {first.pid} on host" in err
        )
        assert "two runs would interleave metrics.jsonl and overwrite report.json" in err and err.count("\n") == 1
        assert sorted(p.name for p in tmp_path.iterdir()) == [".report.lock"]  # nothing of the second job
    finally:
        first.kill()
        first.wait()


def test_the_report_lock_is_the_checkpoint_lock_helper(tmp_path, capsys):
    # one process holds it (the launcher); a dead holder's lock is taken over, and released at the end
    from shardkit.checkpoint.lock import LOCK, REPORT_LOCK, lock_holder, process_lock

    gone = subprocess.Popen(["true"])
    gone.wait()
    _report_held_by(tmp_path, gone.pid)
    (tmp_path / LOCK).write_text("{}")  # the --checkpoint-dir lock of the same folder: another file
    with process_lock(tmp_path, "op"):
        assert "took over the stale lock of run firstjob0001" in capsys.readouterr().err
        assert lock_holder(str(tmp_path), REPORT_LOCK)["pid"] == os.getpid()
        with pytest.raises(ShardkitError, match=r"op: .* is already held by this process"):
            with process_lock(tmp_path, "op"):
                pass
    assert lock_holder(str(tmp_path), REPORT_LOCK) is None and (tmp_path / LOCK).exists()


# --- subprocesses ----------------------------------------------------------------------------


def _shardkit(*argv, timeout):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *argv], capture_output=True, text=True, timeout=patient(timeout), env=env
    )


# The end-to-end run (verify, report, metrics, tensorboard): test_train_run.py, one run for every
# claim about a real run's output.


def test_bad_layout_fails_before_launch():
    proc = _shardkit("train", "--tp", "3", "--nproc", "4", timeout=60)
    # Exit code 2 is the up-front configuration error; a failed worker would give 1.
    assert proc.returncode == 2, proc.stderr
    assert "= 3 ranks must divide --nproc 4" in proc.stderr and not proc.stdout


def test_resume_without_a_save_is_said_before_launch(tmp_path, capsys):
    """A requeued job's first ``--resume`` trains from step 0, and says so on stderr before launch."""
    root = tmp_path / "ckpt"
    config_from_args(_args("--checkpoint-dir", str(root), "--resume"))
    assert f"--resume: no save in {str(root)!r}: this run starts at step 0" in capsys.readouterr().err
    config_from_args(_args("--checkpoint-dir", str(root)))
    assert "--resume" not in capsys.readouterr().err


# The piped run (--log-every, a used --report folder): test_train_run.py::
# test_piped_run_logs_every_n_steps_and_starts_a_fresh_report, on the same run as the end-to-end claims.


def test_summary_shows_parameters_mfu_and_windowed_means(capsys):
    """A noisy run whose last step is above its first reads as falling when the 5-step means fell."""
    from rich.console import Console

    from shardkit.cli.report import print_summary

    losses = [3.0, 3.1, 2.9, 3.0, 3.1] + [2.9] * 10 + [2.7, 2.8, 2.75, 2.85, 3.21]
    result = {
        **_result(passed=True),
        "losses": losses,
        "grad_norms": [1.0] * 20,
        "parameters": 1_234_567,
        "mfu": None,
        "mfu_basis": "n/a on cpu (no peak figure)",
        "eval_losses": [[10, 2.9], [15, 2.85], [20, 2.8]],
    }
    print_summary(result, Console(width=200))
    out = capsys.readouterr().out
    assert "parameters" in out and "1.23 M (1,234,567)" in out
    assert "loss (mean of steps 1-5 -> 16-20)" in out and "3.02000 -> 2.86200" in out
    assert "grad norm (mean of steps 1-5 -> 16-20)" in out and "first -> last" not in out
    assert "MFU" in out and "n/a on cpu (no peak figure)" in out
    assert "held-out loss" in out and "2.90000 (step 10) -> 2.80000 (step 20)" in out
    print_summary({**result, "losses": [2.0, 1.0, float("nan")], "first_step": 4, "mfu": 0.123}, Console(width=200))
    out = capsys.readouterr().out
    assert "loss (mean of steps 5 -> 7)" in out and "2.00000 -> nan" in out and "12.3% n/a on cpu" in out


def test_loss_figure_shows_the_held_out_loss():
    result = {**_figure_result([3.0, 2.5, 2.25, 2.0]), "eval_losses": [[2, 2.6], [4, 2.2]]}
    ax = loss_figure(result).axes[0]
    held = [line for line in ax.lines if line.get_label() == "held-out (--eval-every)"]
    assert len(held) == 1 and list(held[0].get_xdata()) == [2, 4] and list(held[0].get_ydata()) == [2.6, 2.2]


def test_a_corpus_too_short_to_hold_out_is_refused_before_launch(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_bytes(b"x" * 60)
    config_from_args(_args("--data", str(text), "--seq-len", "32"))  # trains without --eval-every
    with pytest.raises(ShardkitError, match="--eval-every: the corpus has 60 tokens; holding out 32"):
        config_from_args(_args("--data", str(text), "--seq-len", "32", "--eval-every", "2"))
