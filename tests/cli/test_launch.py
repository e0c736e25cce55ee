"""The local launcher: a failure on any rank stops the whole job quickly, root cause first."""

from datetime import timedelta

import pytest
import torch.distributed as dist

from shardkit._local_world import init_local_world, private_run_dir
from shardkit.cli.launch import LaunchFailed, launch_local


def fail_on_rank_one(run_dir):
    """Rank 1 raises; rank 0 waits in a barrier that would otherwise block until the timeout."""
    init_local_world(run_dir, timedelta(minutes=30))
    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()


def test_failure_on_one_rank_stops_the_job_with_its_traceback_first():
    with pytest.raises(LaunchFailed) as info, private_run_dir() as run_dir:
        launch_local(2, fail_on_rank_one, run_dir, run_dir=run_dir)
    text = str(info.value)
    assert text.startswith("rank 1 failed first"), text
    root_cause = text.split("\nrank 0")[0]  # everything before a line about the other rank
    assert "deliberate failure on rank 1" in root_cause, text
    # Rank 0 was stopped by the launcher (or by its peer's hang-up), not left in its barrier until
    # the 30-minute gloo timeout: no line says it timed out (a launcher that waited for it would
    # hang here until pytest's limit).
    assert "timed out" not in text.lower(), text


def test_failed_job_prints_where_the_ranks_diverged(tmp_path, capsys):
    # What `shardkit train` prints after a failed launch: the ranks' flight records, compared.
    import dataclasses
    import json

    from shardkit.cli.train import _print_flight_report
    from shardkit.comm.flight_recorder import FlightEntry

    names = [f.name for f in dataclasses.fields(FlightEntry)]
    for rank, ops in ((0, ["all_gather", "all_reduce"]), (1, ["all_gather", "all_to_all"])):
        entries = [
            {
                **dict.fromkeys(names),
                "seq": i,
                "group_seq": i,
                "op": op,
                "api": op,
                "phase": "forward",
                "group": [0, 1],
                "group_name": "tp",
                "shape": [2, 3],
            }
            for i, op in enumerate(ops)
        ]
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "entries": entries}))
    _print_flight_report(str(tmp_path))
    err = capsys.readouterr().err
    assert "diverged" in err and "all_reduce" in err and "all_to_all" in err and str(tmp_path) in err
    _print_flight_report(str(tmp_path / "none"))  # no dumps: nothing printed
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("own", [True, False], ids=["shardkit's error", "another error"])
def test_a_shardkit_error_is_printed_as_its_message_not_a_traceback(tmp_path, own):
    """shardkit's own (agreed) errors are written for the user: the launcher prints the message
    and where it was raised; any other error keeps its whole traceback."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardkit.cli.launch import format_failures

    last = (
        "shardkit.errors.NonFiniteError: step 2: the global loss (nan) is not finite"
        if own
        else "ZeroDivisionError: division by zero"
    )
    stack = (
        'Traceback (most recent call last):\n  File "/x/shardkit/train/run.py", line 204, in _run_steps\n'
        '    _nonfinite_step(step)\n  File "/x/shardkit/train/run.py", line 233, in _nonfinite_step\n'
        f"    raise NonFiniteError(where)\n{last}\n"
    )
    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps({"message": {"message": last, "extraInfo": {"py_callstack": stack, "timestamp": "1"}}})
    )
    text = format_failures(ChildFailedError("worker", {1: ProcessFailure(1, 10, 1, str(error_file))}))
    if own:
        assert text.splitlines() == [
            "rank 1 failed first (exit code 1):",
            "NonFiniteError: step 2: the global loss (nan) is not finite",
            "  (raised at /x/shardkit/train/run.py:233, in _nonfinite_step)",
        ], text
    else:
        assert "Traceback (most recent call last)" in text and "line 204, in _run_steps" in text, text
