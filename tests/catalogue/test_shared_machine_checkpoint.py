"""Issue 19, checkpoints you can trust: the rows of its table about ``--checkpoint-dir``.

* row 2 (its checkpoint part): a NaN inside a checkpoint is refused at load, naming the key; a
  state holding a NaN is never committed as a save (the previous save stays the latest);
* row 3: a planted DCP ``.metadata`` pickle is refused on every rank and never run;
* row 4: a second run on a checkpoint directory in use is refused (the lock), the first run's
  saves stay intact, a save never replaces another run's complete save; a dead run's lock is
  taken over with a message;
* row 7: IO failures (disk full, read-only file system, a truncated shard) are one
  ``ShardkitError`` on every rank naming the path and the cause;
* row 8: corrupted saved bytes (one flipped bit, a NaN written over one value) are refused at
  load, naming the item and its file (per-item SHA-256 in the manifest);
* row 10: a ``--checkpoint-dir`` of ``''``, a file, or a directory holding other files or an
  earlier run's saves (without ``--resume``) is refused before launch;
* row 11 (its checkpoint part): a truncated ``.metadata`` and a garbage manifest are clear errors;
* row 12 (its checkpoint part): ``--keep N`` keeps the newest N saves; a ``latest`` pointing
  outside the root is refused.

Each trainer run is a 2-rank ``tp=2`` float64 run of :func:`shardkit.train.run.train` (what
``shardkit train`` runs on each rank) in a persistent gloo world; files are damaged by rank 0
between runs, as a user, a disk or an attacker would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from harness.tiers import tiered
from shardkit import ShardkitError
from shardkit.checkpoint import MANIFEST, latest_checkpoint
from shardkit.train.checkpoint_dir import check_checkpoint_dir
from shardkit.train.config import TrainConfig, parallel_dims, validate_config
from shardkit.train.run import build_parallel_model, build_task, build_train_model, run_training, train

BASE = dict(seq_len=16, batch_size=4, dtype="float64", layers=2, lr=1e-3, tp=2)
ITEM = "model/model.embed_tokens.weight"
LOCK, METADATA = ".lock", ".metadata"
# The file formats are spelled out here rather than imported, so that this file also runs
# against the code before issue 19 (where each of its tests fails).


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def _key(index) -> str:
    """The manifest's name of a stored item: ``fqn@offsets``."""
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


def _cfg(**kw) -> TrainConfig:
    """A configuration as ``shardkit train`` checks it before launch (layout, then the directory)."""
    cfg = validate_config(TrainConfig(**{**BASE, **kw}), world_size=world_size())
    check_checkpoint_dir(cfg)
    return cfg


def _train(cfg: TrainConfig):
    return train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)


def _on_rank0(fn, *args):
    """Damage files as one process does (rank 0), then let every rank go on."""
    if rank() == 0:
        fn(*args)
    dist.barrier()


def _item(save: str, fqn: str = ITEM) -> tuple[str, str, int, int]:
    """(key, file, offset, length) of ``fqn``'s first stored chunk."""
    md = FileSystemReader(save).read_metadata()  # a save this test just wrote
    index = min((i for i in md.storage_data if i.fqn == fqn), key=_key)
    info = md.storage_data[index]
    return _key(index), os.path.join(save, info.relative_path), info.offset, info.length


def _rehash(save: str, key: str | None = None) -> None:
    """Make the manifest agree with the damaged files (an attacker, or a save of bad data)."""
    manifest = json.load(open(os.path.join(save, MANIFEST)))
    sums = manifest.setdefault("checksums", {"items": {}})  # (before issue 19 a manifest had none)
    sums["metadata"] = hashlib.sha256(open(os.path.join(save, METADATA), "rb").read()).hexdigest()
    if key is not None:
        _, file, offset, length = _item(save, key.rpartition("@")[0])
        with open(file, "rb") as f:
            f.seek(offset)
            sums["items"][key] = hashlib.sha256(f.read(length)).hexdigest()
    with open(os.path.join(save, MANIFEST), "w") as f:
        json.dump(manifest, f)


def _write_nan(save: str) -> None:
    """Overwrite the first value of ``ITEM``'s first chunk with a NaN, in place."""
    _, file, offset, length = _item(save)
    with open(file, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    first = torch.load(io.BytesIO(data), weights_only=True).reshape(-1)[0].item()
    old, new = (
        torch.tensor([first], dtype=torch.float64).numpy().tobytes(),
        torch.tensor([math.nan], dtype=torch.float64).numpy().tobytes(),
    )
    assert data.count(old) >= 1
    with open(file, "r+b") as f:
        f.seek(offset + data.index(old))
        f.write(new)


def _flip_bit(save: str) -> None:
    _, file, offset, length = _item(save)
    with open(file, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + length // 2)
        f.write(bytes([byte ^ 0x10]))


class _Planted:
    """A pickle that creates a file when unpickled (standing for any code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("rehash", [True, False], ids=["manifest rewritten too", "manifest left"])
def test_planted_metadata_is_refused_on_every_rank_and_never_run(rehash):
    """Row 3: the attacker writes ``.metadata`` (and, first case, the manifest's hash of it)."""
    root = shared_tmpdir("shardkit-planted-")
    marker = os.path.join(root, "..", os.path.basename(root) + "-ran")
    try:
        _train(_cfg(steps=1, checkpoint_dir=root))
        save = os.path.join(root, "step_00000001")

        def plant():
            with open(os.path.join(save, METADATA), "wb") as f:
                pickle.dump(_Planted(marker), f)
            if rehash:
                _rehash(save)

        _on_rank0(plant)
        why = (
            "names the global .*open, which a checkpoint's metadata never holds"
            if rehash
            else r"\.metadata differs from the save's manifest \(SHA-256 mismatch\)"
        )
        with pytest.raises(
            ShardkitError,
            match=rf"load_train_state: checkpoint refused on every rank .*ranks 0, 1: "
            rf"cannot read .*{why}",
        ):
            _train(_cfg(steps=2, checkpoint_dir=root, resume=True))
        dist.barrier()
        assert not os.path.exists(marker)
    finally:
        if rank() == 0 and os.path.exists(marker):
            os.remove(marker)
        remove_shared_dir(root)


def _fake_live_run(root: str) -> subprocess.Popen:
    """Rank 0: a live process holding ``root``'s lock, as a run in progress does."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(root, LOCK), "w") as f:
        json.dump(
            {
                "run_id": "firstrun0001",
                "host": socket.gethostname(),
                "pid": holder.pid,
                "start": _start_time(holder.pid),
            },
            f,
        )
    return holder


@pytest.mark.world(2, timeout=150)
def test_a_second_run_on_a_directory_in_use_is_refused_and_the_first_saves_stay():
    """Row 4: run A saved steps 1-2 and still runs (holds the lock): run B is refused before
    launch and, if launched anyway, in its workers; A's saves are untouched. A save never
    replaces another run's complete save. Once A is gone, its lock is taken over."""
    root = shared_tmpdir("shardkit-twojobs-")
    holder = None
    try:
        fresh = _cfg(steps=1, checkpoint_dir=root)  # validated while the directory was empty
        resume = _cfg(steps=3, checkpoint_dir=root, resume=True)
        _train(_cfg(steps=2, save_every=1, checkpoint_dir=root))
        manifests = {n: open(os.path.join(root, n, MANIFEST), "rb").read() for n in ("step_00000001", "step_00000002")}
        box = [None]
        if rank() == 0:
            holder = _fake_live_run(root)
            box = [holder.pid]
        dist.broadcast_object_list(box, src=0)
        pid = box[0]
        with pytest.raises(
            ShardkitError,
            match=rf"--checkpoint-dir .* is in use by run firstrun0001 \(pid {pid} on "
            rf"host {socket.gethostname()}\)",
        ):
            _cfg(steps=3, checkpoint_dir=root, resume=True)
        for cfg in (resume, fresh):
            with pytest.raises(
                ShardkitError,
                match=rf"shardkit train --checkpoint-dir: the checkpoint directory "
                rf"{root} is in use by run firstrun0001 \(pid {pid}",
            ):
                _train(cfg)
        dist.barrier()
        assert {n: open(os.path.join(root, n, MANIFEST), "rb").read() for n in manifests} == manifests
        assert latest_checkpoint(root).endswith("step_00000002")
        dist.barrier()
        if rank() == 0:  # run A ends without releasing (killed): its lock is stale
            holder.kill()
            holder.wait()
        dist.barrier()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            result = _train(resume)
        if rank() == 0:
            assert "took over the stale lock of run firstrun0001" in err.getvalue()
            assert result["first_step"] == 2
            assert not os.path.exists(os.path.join(root, LOCK))  # released at the end
        # a fresh run (validated before A's saves existed) would write step 1 again: refused
        # (since issue 31, when it takes the lock, before training; before, at its first save)
        with pytest.raises(
            ShardkitError,
            match=r"step_00000001 is a complete save of an earlier run; a save never "
            r"replaces it|holds the saves of an earlier run \(step_00000003, 3 in all\); pass --resume",
        ):
            _train(fresh)
        assert {n: open(os.path.join(root, n, MANIFEST), "rb").read() for n in manifests} == manifests
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("fault", ["disk full on rank 1", "read-only file system"])
def test_io_failures_are_one_error_with_the_path_and_the_cause(fault):
    """Row 7: DCP's CheckpointException (a BaseException) as a ShardkitError with errno text.
    (Injected: the tests run as root, for whom a read-only mode bit does not stop a write.)"""
    from torch.distributed.checkpoint.filesystem import FileSystem

    root = shared_tmpdir("shardkit-ioerr-")
    real = FileSystem.create_stream
    code, text = (
        (errno.ENOSPC, "No space left on device") if "disk" in fault else (errno.EROFS, "Read-only file system")
    )

    @contextlib.contextmanager
    def failing(self, path, mode):
        if "w" in mode and (rank() == 1 or code == errno.EROFS):
            raise OSError(code, os.strerror(code), str(path))
        with real(self, path, mode) as stream:
            yield stream

    try:
        _train(_cfg(steps=1, checkpoint_dir=root))
        FileSystem.create_stream = failing
        try:
            first = 1 if code == errno.ENOSPC else 0  # the first rank that failed (each rank names its file)
            with pytest.raises(
                ShardkitError,
                match=rf"save_train_state: writing {root}/step_00000002 failed: rank "
                rf"{first}: {text} \[errno {code}\] \({root}/step_00000002/__",
            ):
                _train(_cfg(steps=2, checkpoint_dir=root, resume=True))
        finally:
            FileSystem.create_stream = real
        dist.barrier()
        assert latest_checkpoint(root).endswith("step_00000001")
    finally:
        remove_shared_dir(root)


# Quick tier: one flipped bit (the checksum's refusal); a NaN (also test_a_nan_inside_...) and a
# truncated shard take 10-13 s each at load 40 through the same refusal (issue 32, item 4).
DAMAGES = ("one flipped bit", "a NaN written over one value", "a truncated shard")


@pytest.mark.world(2, timeout=120)
@pytest.mark.parametrize("damage", tiered({d: d for d in DAMAGES}, DAMAGES[:1]))
def test_corrupted_saved_bytes_are_refused_naming_the_item(damage):
    """Rows 7, 8: the bytes of one item changed after the save; the load names it, on every rank."""
    root = shared_tmpdir("shardkit-corrupt-")
    try:
        _train(_cfg(steps=1, checkpoint_dir=root))
        save = os.path.join(root, "step_00000001")
        key, file, offset, length = _item(save)
        if damage == "a truncated shard":
            _on_rank0(os.truncate, file, offset + length // 2)
            # refused when the metadata is checked, before reading (issue 31): on every rank
            with pytest.raises(
                ShardkitError,
                match=rf"load_train_state: checkpoint refused on every rank .*ranks 0, 1: cannot read {save}: "
                rf".*item '{ITEM}' at chunk offset \[0, 0\] claims bytes {offset}\.\.{offset + length} of "
                rf"{os.path.basename(file)}, which holds {offset + length // 2} \(truncated",
            ):
                _train(_cfg(steps=2, checkpoint_dir=root, resume=True))
            return
        else:
            _on_rank0(_flip_bit if "bit" in damage else _write_nan, save)
            why = rf"{ITEM} at chunk offset \[0, 0\] differs from its checksum in the manifest"
        with pytest.raises(ShardkitError, match=rf"load_train_state: reading {save} failed: rank.*{file}: item {why}"):
            _train(_cfg(steps=2, checkpoint_dir=root, resume=True))
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_a_nan_inside_a_checkpoint_is_refused_naming_the_key():
    """Row 2: a NaN that the manifest's checksums agree with (saved as good by an older
    shardkit, or rewritten) is refused after reading, on every rank."""
    root = shared_tmpdir("shardkit-nanload-")
    try:
        _train(_cfg(steps=1, checkpoint_dir=root))
        save = os.path.join(root, "step_00000001")
        key = _item(save)[0]
        _on_rank0(lambda: (_write_nan(save), _rehash(save, key)))
        with pytest.raises(
            ShardkitError,
            match=rf"load_train_state: ranks? .*{save} holds non-finite values \(NaN or "
            rf"inf\) in {ITEM}: refused",
        ):
            _train(_cfg(steps=2, checkpoint_dir=root, resume=True))
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_a_state_with_a_nan_is_never_saved():
    """Row 2: rank 1's weights turn NaN after step 2; its save is refused on every rank and the
    step-1 save stays the latest."""
    root = shared_tmpdir("shardkit-nansave-")
    try:
        cfg = _cfg(steps=2, save_every=1, checkpoint_dir=root)
        device = torch.device("cpu")
        task = build_task(cfg, device)
        pm, loss_scale = build_parallel_model(
            build_train_model(cfg), parallel_dims(cfg).build_mesh("cpu"), cfg, task, device
        )

        def poison(step, loss):
            if step == 1 and rank() == 1:
                with torch.no_grad():
                    next(pm.module.parameters()).view(-1)[0] = float("nan")

        with pytest.raises(
            ShardkitError,
            match=r"save_train_state: rank 1: refused to save non-finite values \(NaN or "
            r"inf\) in model/.*the previous save stays the latest",
        ):
            run_training(pm, task, cfg, loss_scale, on_step=poison)
        dist.barrier()
        assert latest_checkpoint(root).endswith("step_00000001")
        assert not os.path.exists(os.path.join(root, "step_00000002"))
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
# Quick tier: the workers' refusal (manifest rewritten) and the launch check's (garbage manifest).
@pytest.mark.parametrize(
    "damage",
    tiered(
        {d: d for d in ("truncated .metadata", "truncated .metadata, manifest rewritten", "garbage manifest")},
        ("truncated .metadata, manifest rewritten", "garbage manifest"),
    ),
)
def test_a_damaged_save_is_a_clear_error(damage):
    """Row 11: before launch (the manifest) and in the workers (every rank, the same text)."""
    root = shared_tmpdir("shardkit-damaged-")
    try:
        _train(_cfg(steps=1, checkpoint_dir=root))
        resume = _cfg(steps=2, checkpoint_dir=root, resume=True)  # validated before the damage
        save = os.path.join(root, "step_00000001")
        if damage == "garbage manifest":
            _on_rank0(lambda: open(os.path.join(save, MANIFEST), "wb").write(b"\x00garbage{"))
            with pytest.raises(
                ShardkitError,
                match=r"--checkpoint-dir .*: cannot resume: .*MANIFEST.json is damaged "
                r"\(not JSON",
            ):
                _cfg(steps=2, checkpoint_dir=root, resume=True)
            # the run checks its directory again once it holds the lock (issue 31): refused there,
            # on every rank, before the load
            with pytest.raises(
                ShardkitError,
                match=rf"shardkit train --checkpoint-dir: --checkpoint-dir .*: cannot resume: {save}/"
                r"MANIFEST.json is damaged \(not JSON.*\(checked again once the lock was taken\)",
            ):
                _train(resume)
            return
        else:
            file = os.path.join(save, METADATA)
            _on_rank0(
                lambda: (
                    os.truncate(file, os.path.getsize(file) // 2),
                    _rehash(save) if "rewritten" in damage else None,
                )
            )
            why = (
                r"\.metadata is truncated or not a DCP metadata file"
                if "rewritten" in damage
                else r"\.metadata differs from the save's manifest"
            )
        with pytest.raises(
            ShardkitError,
            match=rf"load_train_state: checkpoint refused on every rank .*ranks 0, 1: "
            rf"cannot read {save}: .*{why}",
        ):
            _train(resume)
    finally:
        remove_shared_dir(root)


@pytest.mark.world(2, timeout=120)
def test_keep_holds_the_newest_saves():
    """Row 12: ``--keep 2`` over 4 saves leaves steps 3 and 4."""
    root = shared_tmpdir("shardkit-keep-")
    try:
        _train(_cfg(steps=4, save_every=1, keep=2, checkpoint_dir=root))
        dist.barrier()
        assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
            "latest",
            "step_00000003",
            "step_00000004",
        ]
    finally:
        remove_shared_dir(root)


def test_latest_outside_the_root_is_refused(tmp_path):
    """Row 12: ``latest`` naming ``../elsewhere`` (a complete save there) is never followed."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    (root / "step_00000001").mkdir(parents=True)
    (root / "step_00000001" / MANIFEST).write_text(json.dumps({"step": 1, "model": {}}))
    elsewhere.mkdir()
    (elsewhere / MANIFEST).write_text(json.dumps({"step": 9}))
    (root / "latest").write_text("../elsewhere")
    with pytest.raises(ShardkitError, match=r"latest names '../elsewhere', which is not a save inside"):
        latest_checkpoint(root)
    with pytest.raises(
        ShardkitError,
        match=r"--checkpoint-dir .*: cannot resume: .*'../elsewhere', which is not a "
        "save inside",
    ):
        check_checkpoint_dir(validate_config(TrainConfig(**BASE, checkpoint_dir=str(root), resume=True)))


@pytest.mark.parametrize(
    "setup,message",
    [
        ("''", r"--checkpoint-dir '': give a directory"),
        ("a file", r"exists and is not a directory"),
        ("other files", r"holds files that are not shardkit train saves \(notes.txt\)"),
        (
            "saves of an earlier run",
            r"holds the saves of an earlier run \(step_00000002, 2 in all\); pass --resume to "
            "continue it or choose another directory",
        ),
        (
            "a save of another model",
            r"--resume from step_00000002, a save of another model: hidden_size 32 "
            r"\(checkpoint\) vs 64 \(this run\)",
        ),
        ("--keep 0", r"--keep must be >= 1"),
    ],
)
def test_checkpoint_dir_is_refused_before_launch(tmp_path, setup, message):
    """Row 10: what would fail at the first save, after training, or mix runs, fails here."""
    root = tmp_path / "ckpt"
    kw: dict = {}
    if setup == "''":
        root = ""
    elif setup == "a file":
        root.write_text("x")
    elif setup == "other files":
        root.mkdir()
        (root / "notes.txt").write_text("user data")
    elif setup == "--keep 0":
        kw["keep"] = 0
    else:
        described = dataclasses.asdict(TrainConfig(**BASE))
        model = {
            "model": "llama",
            "dtype": "float64",
            **{k: described[k] for k in ("hidden_size", "layers", "heads", "kv_heads", "intermediate_size")},
        }
        if setup == "a save of another model":
            model["hidden_size"], kw["resume"] = 32, True
        for step in (1, 2):
            (root / f"step_{step:08d}").mkdir(parents=True)
            (root / f"step_{step:08d}" / MANIFEST).write_text(json.dumps({"step": step, "model": model}))
        (root / "latest").write_text("step_00000002")
    with pytest.raises(ShardkitError, match=message):
        check_checkpoint_dir(validate_config(TrainConfig(**BASE, checkpoint_dir=str(root), **kw)))


def test_a_save_of_an_earlier_shardkit_passes_the_launch_check(tmp_path):
    """Its manifest describes no model: --resume is not refused before launch (the load's own
    check of every key's shape and dtype still refuses another model, on every rank)."""
    root = tmp_path / "ckpt"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / MANIFEST).write_text(json.dumps({"step": 2, "layout": "tp=2", "keys": 9}))
    (root / "latest").write_text("step_00000002")
    cfg = validate_config(TrainConfig(**BASE, checkpoint_dir=str(root), resume=True))
    check_checkpoint_dir(cfg)
    assert cfg.resume and cfg.checkpoint_dir == str(root)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_nonfinite_check_is_exact(dtype):
    """Rows 2 and 8's check (a min/max pass): every NaN or inf found wherever it sits, and the
    largest finite values of the dtype never mistaken for one (as a sum or a cast would)."""
    from shardkit.checkpoint.integrity import nonfinite_keys

    for n in (1, 7, 64, 4097):
        for pos in sorted({0, n // 2, n - 1}):
            for value in (math.nan, math.inf, -math.inf):
                t = torch.randn(n, dtype=torch.float64).to(dtype)
                t[pos] = value
                state = {
                    "a": torch.randn(3, dtype=torch.float64).to(dtype),
                    "b": t.reshape(1, -1),
                    "ids": torch.arange(3),
                }
                assert nonfinite_keys(state) == ["b"], (n, pos, value)
    largest = torch.finfo(dtype).max
    assert (
        nonfinite_keys({"x": torch.full((4,), largest, dtype=dtype), "y": torch.full((4,), -largest, dtype=dtype)})
        == []
    )
