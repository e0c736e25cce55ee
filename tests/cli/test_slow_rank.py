"""A slow but alive rank (issue 31, finding 5): its peers time out waiting for it in a collective.

Every rank still beats and none makes progress, so the watchdog rightly stops nobody; after the
failure the launcher must name the slow rank from the flight records' entry times (who entered
the call, and when), not the waiting rank's timeout traceback ("rank 0 failed first" and ~100
lines of gloo frames before this fix)."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness.limits import patient
from shardkit._local_world import init_local_world, private_run_dir
from shardkit.cli.launch import LaunchFailed, launch_local
from shardkit.comm import flight_recorder
from shardkit.comm.collectives import all_reduce_forward
from shardkit.comm.flight_report import FlightEntry, waited_for
from shardkit.train.liveness import Heartbeat, set_phase

TIMEOUT_S = 2.0  # the process-group timeout on a quiet machine (stretched by load: ``patient``)


def _stop_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # as the trainer's workers do: the flight record is written on the way out


def one_rank_slow(run_dir: str, flight: str, slow: int, timeout: float) -> None:
    """Two all-reduces; before the second, rank ``slow`` computes for three timeouts (beating)."""
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    rank = int(os.environ["RANK"])
    with Heartbeat(flight, rank, interval=0.5):
        init_local_world(run_dir, timedelta(seconds=timeout))
        try:
            set_phase("training")
            group = dist.group.WORLD
            all_reduce_forward(torch.ones(4), group)
            if rank == slow:
                time.sleep(3 * timeout)
            all_reduce_forward(torch.ones(4), group)
        except BaseException as exc:
            flight_recorder.dump_all(flight, reason=f"{type(exc).__name__}: {exc}"[:500])
            raise


# A process-level fault trial, ~20-30 s of waiting each: the slow tier's. The quick tier keeps the
# naming rule itself, on hand-made records (the tests below).
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("slow", [1, 0])
def test_the_slow_rank_is_named_not_the_rank_that_timed_out_waiting(tmp_path, capsys, slow):
    flight, timeout = str(tmp_path / "flight"), patient(TIMEOUT_S)
    with pytest.raises(LaunchFailed) as info, private_run_dir() as run_dir:
        launch_local(
            2, one_rank_slow, run_dir, flight, slow, timeout, run_dir=run_dir, heartbeats=flight, timeout_s=timeout
        )
    text = str(info.value)
    first = text.splitlines()[0]
    waiting = 1 - slow
    assert first.startswith(f"rank {slow} was slow"), text
    assert f"rank {waiting} waited" in first and "all_reduce" in first, text
    assert "watchdog" not in capsys.readouterr().err  # every rank beat: nobody was stopped
    assert "Traceback" not in text and len(text.splitlines()) <= 3, text  # no gloo frames


def _e(gseq, t, op="all_reduce", group=(0, 1, 2), name="g", peer=None, src=None, dst=None):
    return FlightEntry(gseq, gseq, op, op, "forward", group, name, (4,), None, peer, src, dst, t)


def test_waited_for_on_hand_made_records():
    # rank 2 entered call 1 nine seconds after ranks 0 and 1; a 3 s window counts it late
    dumps = {r: [_e(0, 100.0), _e(1, 110.0 + (9.0 if r == 2 else 0.1 * r))] for r in range(3)}
    (w,) = waited_for(dumps, 3.0)
    assert (w.late, w.waiting, w.seconds) == (2, (0, 1), 9.0)
    assert "ranks 0, 1 waited for it in all_reduce [4]" in w.describe() and "entered it 9.0 s after" in w.describe()
    assert waited_for(dumps, 10.0) == []  # within the window: nobody waited
    # a rank that never reached the call
    dumps[2] = dumps[2][:1]
    (w,) = waited_for(dumps, 3.0)
    assert (w.late, w.seconds) == (2, None) and "had not reached it" in w.describe()
    # records of releases without entry times: no verdict
    assert waited_for({r: [_e(0, None), _e(1, None)] for r in range(2)}, 3.0) == []


def test_the_root_of_a_chain_of_waits_comes_first():
    """Rank 0 waits in the dp group for rank 2 (slow); rank 1 waits in the tp group for rank 0,
    which is stuck in dp. Rank 2 waits nowhere: it is the cause, named first although rank 1's
    wait began later."""
    dp, tp = (0, 2), (0, 1)
    dumps = {
        0: [_e(0, 10.0, group=dp, name="dp")],
        1: [_e(0, 5.0, group=tp, name="tp"), _e(1, 12.0, group=tp, name="tp")],
        2: [],
    }
    dumps[0].insert(0, _e(0, 4.9, group=tp, name="tp"))
    waits = waited_for(dumps, 2.0)
    assert [(w.late, w.waiting) for w in waits] == [(2, (0,)), (0, (1,))]


def test_a_receiver_waits_for_its_sender():
    """P2P: rank 1 posted its second receive from rank 0, which never sent it."""
    pair = (0, 1)
    sends = [_e(0, 1.0, op="send", group=pair, peer=1, src=0, dst=1)]
    recvs = [_e(g, t, op="recv", group=pair, peer=0, src=0, dst=1) for g, t in ((0, 1.0), (1, 8.0))]
    (w,) = waited_for({0: sends, 1: recvs}, 2.0)
    assert (w.late, w.waiting, w.seconds) == (0, (1,), None) and "recv [4] from rank 0" in w.describe()
