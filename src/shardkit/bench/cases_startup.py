"""Time to the first step: ``shardkit train --steps 1`` against a plain torchrun-launched script
on the same layout (issue 32, item 5).

What is timed: from starting the command to the line that says its first step is done, read
from its stdout as it comes (the teardown after it is not timed): ``shardkit train``'s ``step
1/1`` (``--log-every 1``, stdout a pipe) and the baseline's ``first step done``. That includes
the launcher's interpreter and imports, the ranks' start (shardkit: forked from a forkserver
that imported torch, shardkit and the model code once; torchrun: one fresh interpreter per
rank, each importing torch and transformers), the world's join, the model's build and
parallelization and one optimizer step; shardkit's also its pre-launch checks and reading the
corpus (the baseline trains on random tokens).

Like with like: the same 4 ranks, ``dp_replicate x tp`` mesh, model (the config ``shardkit
train`` builds, written to a file for the baseline: :mod:`.startup_baseline`, sharded by torch's
own ``parallelize_module``), batch and sequence length; the same thread settings
(``OMP_NUM_THREADS=1`` for both commands, and each rank calls ``torch.set_num_threads(1)``);
shardkit with ``--no-sequence-parallel``, the baseline's plain column / row split (Megatron-LM's
tensor parallelism without sequence parallelism).

Each round launches both, one after the other in alternating order, as subprocesses of this
rank (a case of one rank: each launch starts its own world of 4 ranks). A launch costs tens of
seconds on a busy 2-core machine, so this case runs 3 rounds (1 with ``--quick``) and no
warm-up instead of docs/design.md's 40 after 5: the ratio's spread over the rounds says how far
to trust it. Goal: ``shardkit/torchrun`` <= 1 (no slower than torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from ..train.config import TrainConfig, validate_config
from ..train.model import hf_config
from ..train.specs import model_spec
from ._method import Record, Settings

__all__ = ["startup", "time_to_line", "launches", "ENV"]

_BASELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup_baseline.py")
# Both commands: one thread per rank's process (each rank also calls torch.set_num_threads(1)).
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
LAUNCH_TIMEOUT_S = 900  # one launch at load 60 took up to 160 s to join (issue 32): this bounds a hang only


def time_to_line(
    argv: list[str],
    marker: str,
    env: dict,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds from starting ``argv`` to the first stdout line starting with ``marker``; the
    process is then waited for (its teardown is not timed).

    ``clock`` (seconds) is read once before the start and once per line as it is read; the
    time is its reading at the marker line less the first (tests pass a counter).

    Raises:
        AssertionError: the process ended without that line or with a non-zero exit code (its
            output's tail in the message), or ran past ``timeout_s``.
    """
    t0 = clock()
    seen, lines = None, []
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = clock()
            lines.append(line)
            if seen is None and line.startswith(marker):
                seen = now - t0
            if now - t0 > timeout_s:
                proc.kill()
                raise AssertionError(f"{argv[:4]}: no exit within {timeout_s} s")
        rc = proc.wait(timeout=timeout_s)
    assert rc == 0 and seen is not None, f"{' '.join(argv[:6])}: exit {rc}, {marker!r} seen: {seen is not None}\n" + (
        "".join(lines[-30:])
    )
    return seen


def launches(cfg: TrainConfig, config_path: str) -> dict[str, tuple[list[str], str]]:
    """``{name: (argv, marker line)}`` of the two commands: ``shardkit train`` at ``cfg``'s
    defaults (without sequence parallelism) and torchrun running the baseline on ``cfg``'s ranks,
    mesh, batch and sequence length with the model config in ``config_path``."""
    layout = [str(cfg.dp_replicate), str(cfg.tp), str(cfg.batch_size), str(cfg.seq_len)]
    return {
        "shardkit": (
            [sys.executable, "-m", "shardkit", "train", "--steps", "1", "--log-every", "1", "--no-sequence-parallel"],
            "step 1/1",
        ),
        "torchrun": (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cfg.nproc)]
            + [_BASELINE, config_path, *layout],
            "first step done",
        ),
    }


def startup(pg, settings: Settings) -> list[Record]:
    """``shardkit`` (``shardkit train --steps 1``, default layout without sequence parallelism)
    against ``torchrun`` (the plain script), per round; ratio ``shardkit/torchrun``."""
    del pg  # the launches start their own worlds
    cfg = validate_config(TrainConfig(steps=1, log_every=1, sequence_parallel=False))
    assert cfg.nproc is not None and cfg.dp_replicate is not None and cfg.tp is not None
    family = model_spec(cfg.model).family
    assert family is not None  # the default model is a decoder
    with tempfile.TemporaryDirectory(prefix="shardkit-startup-") as tmp:
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            json.dump(hf_config(cfg, family)[1].to_dict(), f)
        runs = launches(cfg, config_path)
        rounds = 1 if settings.quick else 3
        times: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(rounds):
            for name in list(runs) if i % 2 == 0 else reversed(list(runs)):
                argv, marker = runs[name]
                times[name].append(time_to_line(argv, marker, {**os.environ, **ENV}))
    rec = Record(
        "startup",
        dict(label=f"{cfg.model} dp_replicate={cfg.dp_replicate} x tp={cfg.tp}, {cfg.nproc} ranks, launch to step 1"),
        1,
        times,
        checked="both launches exit 0 after saying their first step is done",
    )
    return [rec.ratio("shardkit/torchrun", "shardkit", "torchrun", 1.0)]
