"""What a checkpoint save spends on its checksums and its non-finite check (issue 19).

One process (a gloo world of 1): ``save_sharded_checkpoint`` of an 8-layer linear model holding
``MIB`` MiB of float32 state, then a verified load and the same load through DCP's own reader
(no checks, for comparison), four times; the first round is a warm-up.
The two phases are timed by wrapping ``shardkit.checkpoint.saves``'s own functions, so the
numbers are shares of the same saves. Usage: ``python scripts/save_cost.py [MIB]`` (default 256).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta

# torch and shardkit's checkpoint modules are imported where they are used, so that --help
# answers before torch is imported (seconds of CPU; tests/test_scripts.py checks the imports)


def _timed(times: dict[str, list[float]], name: str, key: str) -> None:
    """Wrap ``saves.<name>`` so that its seconds add to ``times[key][-1]``."""
    import shardkit.checkpoint.saves as saves

    original = getattr(saves, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times[key][-1] += time.perf_counter() - t0

    setattr(saves, name, wrapper)


def main(mib: int) -> str:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from shardkit.checkpoint.chunks import ChunkLoadPlanner
    from shardkit.checkpoint.dcp import _state, load_sharded_checkpoint, save_sharded_checkpoint
    from shardkit.checkpoint.versioned import latest_checkpoint

    folder = tempfile.mkdtemp(prefix="shardkit-save-cost-")
    try:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(folder, "store"), 1),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=120),
        )
        rows = mib * (1 << 20) // 4 // 8 // 1024  # 8 layers of [rows, 1024] float32
        model = nn.Sequential(*[nn.Linear(1024, rows, bias=False) for _ in range(8)])
        times: dict[str, list[float]] = {"checksums": [], "nonfinite": [], "save": [], "load": [], "dcp_load": []}
        _timed(times, "_gather_checksums", "checksums")
        _timed(times, "nonfinite_keys", "nonfinite")
        root = os.path.join(folder, "checkpoint")
        for _ in range(4):
            times["checksums"].append(0.0)
            times["nonfinite"].append(0.0)
            t0 = time.perf_counter()
            save_sharded_checkpoint(model, root, dist.group.WORLD, keep=1)
            times["save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load_sharded_checkpoint(model, root, dist.group.WORLD)
            times["load"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()  # the same save through DCP's own reader: no checks at all
            state = _state(model)
            dcp.load(
                state, storage_reader=dcp.FileSystemReader(latest_checkpoint(root)), planner=ChunkLoadPlanner(state)
            )
            times["dcp_load"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        return (
            f"state {mib} MiB float32, median of 3 saves after a warm-up: save {med['save']:.2f} s, of it "
            f"checksums {med['checksums']:.2f} s ({med['checksums'] / med['save']:.0%}), non-finite check "
            f"{med['nonfinite']:.3f} s; verified load {med['load']:.2f} s, DCP's unchecked reader "
            f"{med['dcp_load']:.2f} s"
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mib", type=int, nargs="?", default=256, help="MiB of float32 state to save (default 256)")
    print(main(parser.parse_args().mib))
