"""Issue 31, item 2: an untrusted DCP ``.metadata`` costs bounded work and every refusal is a
``ShardkitError`` naming the file and what is wrong.

Each hostile file is built from allow-listed classes only (nothing here runs code): the bytes of
a small, valid protocol-2 metadata pickle with one field's opcodes spliced in (a 100-level tuple
DAG, 10^7 nested tuples), or a valid pickle whose sizes lie. They are refused before anything
hashes, allocates or reads with them: the reader's own checks, then ``open_save`` / ``export_hf``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from harness.hostile import PLACEHOLDER, dag_ops, deep_ops, spliced
from shardkit import ShardkitError
from shardkit.checkpoint.reader import read_metadata

DATA = "__0_0.distcp"


def _metadata(size=(2,), chunk=(2,), length=16, offset="placeholder", fqn="w") -> Metadata:
    """One float32 tensor ``w`` in one chunk; its storage index's offset is ``PLACEHOLDER``
    (set after the dict is built, so nothing hashes it) unless ``offset`` is None."""
    index = MetadataIndex(fqn, torch.Size([0] * len(size)))
    md = Metadata(
        state_dict_metadata={
            fqn: TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size(size),
                [ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(chunk))],
            )
        },
        storage_data={index: _StorageInfo(DATA, 0, length)},
    )
    if offset == "placeholder":
        object.__setattr__(index, "offset", PLACEHOLDER)
    return md


def _spliced(ops: bytes) -> bytes:
    """A protocol-2 metadata pickle whose storage offset is what ``ops`` push."""
    return spliced(_metadata(offset=None), ops)


def _save(tmp_path, data: bytes, length: int = 16) -> str:
    (tmp_path / ".metadata").write_bytes(data)
    (tmp_path / DATA).write_bytes(bytes(length))
    return str(tmp_path)


@pytest.mark.parametrize(
    "case,message",
    [
        ("a 20-level tuple DAG as an offset", r"memo entry \d+, a container, is used twice"),
        ("an offset nested 100 deep", r"objects nested more than 32 levels deep"),
        ("a tensor of [2^20, 2^20]", r"tensor 'w'.*claims \d+ elements .*more than its stored 16 bytes"),
        (
            "an item of length 2^40",
            r"item 'w' at chunk offset \[0\] claims bytes 0\.\.1099511627776 of __0_0\.distcp, which holds 16",
        ),
        ("a size covering more than its chunks", r"tensor 'w' claims size \[1048576\] .* its chunks hold 2"),
    ],
)
def test_hostile_metadata_is_refused_naming_the_file(tmp_path, case, message):
    """Each crafted field is refused by ``read_metadata`` with a ShardkitError naming the file,
    before a tensor of it is allocated or a byte range read (the old reader accepted all of them:
    hashing the small DAG, or leaving the export a raw allocator error)."""
    data = {
        "a 20-level tuple DAG as an offset": _spliced(dag_ops(20)),
        "an offset nested 100 deep": _spliced(deep_ops(100)),
        "a tensor of [2^20, 2^20]": pickle.dumps(_metadata((2**20, 2**20), (2**20, 2**20), offset=None)),
        "an item of length 2^40": pickle.dumps(_metadata(length=2**40, offset=None)),
        "a size covering more than its chunks": pickle.dumps(_metadata((2**20,), (2,), offset=None)),
    }[case]
    path = _save(tmp_path, data)
    with pytest.raises(
        ShardkitError, match=rf"{re.escape(str(tmp_path))}/\.metadata(:| is refused unread:) .*{message}"
    ):
        read_metadata(path, None)
    assert pickle.dumps(_metadata(offset=None))  # the template itself is a valid save:
    _save(tmp_path, pickle.dumps(_metadata(offset=None)))
    assert list(read_metadata(path, None).state_dict_metadata) == ["w"]


# Slow tier (issue 32, item 4): a fresh process (an import of torch) and a 10^7-deep pickle for the
# same two rules the quick tier holds in-process on smaller files: a container used twice (the
# 20-level DAG) and nesting past 32 levels (100 deep), in
# test_hostile_metadata_is_refused_naming_the_file. What only this test proves, that neither is
# refused after the work it refuses (2^100 hashes), CI still checks.
@pytest.mark.slow
def test_the_hash_bomb_and_deep_nesting_are_refused_quickly(tmp_path):
    """The issue's files: a 100-level DAG (2^100 hashes) and 10^7 nested tuples as an offset.
    Run in a fresh process with a deadline, since the old reader never returns from them."""
    for name, ops in (("dag", dag_ops(100)), ("deep", deep_ops(10**7))):
        (tmp_path / name).mkdir()
        _save(tmp_path / name, _spliced(ops))
    script = textwrap.dedent(
        f"""
        import time
        from shardkit import ShardkitError
        from shardkit.checkpoint.reader import read_metadata
        for name in ("dag", "deep"):
            start = time.perf_counter()
            try:
                read_metadata({str(tmp_path)!r} + "/" + name, None)
                print(name, "accepted")
            except ShardkitError as exc:
                print(name, round(time.perf_counter() - start, 2), exc)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90, env=env)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert set(lines) == {"dag", "deep"}, done.stdout + done.stderr
    for name, why in (("dag", "is used twice"), ("deep", "nested more than 32 levels deep")):
        seconds, text = lines[name].split(" ", 1)
        assert float(seconds) < 10 and why in text and f"{name}/.metadata is refused unread" in text, lines[name]


def test_a_torch_global_is_refused_before_any_attribute_lookup(tmp_path, monkeypatch):
    """``torch.<name>`` is checked against the allow-list before anything is looked up: torch's
    module ``__getattr__`` (which imports the submodule a name names, e.g. ``torch._inductor``)
    is never called."""
    calls = []

    def spy(name):
        calls.append(name)
        raise AttributeError(name)

    for name in ("shardkit_probe", "_inductor"):
        if name in vars(torch):  # imported by an earlier test: looked up afresh here
            monkeypatch.delattr(torch, name)
    monkeypatch.setattr(torch, "__getattr__", spy, raising=False)
    for name in ("shardkit_probe", "_inductor"):
        data = b"\x80\x02ctorch\n" + name.encode() + b"\nq\x00."
        _save(tmp_path, data)
        with pytest.raises(
            ShardkitError, match=rf"\.metadata is not a DCP metadata file: it names the global torch\.{name}"
        ):
            read_metadata(str(tmp_path), None)
    assert calls == []


def _manifest_save(tmp_path, metadata: bytes, checksums: bool) -> str:
    """A save directory as export and resume read it: manifest (with an ``hf`` entry), metadata, data."""
    path = _save(tmp_path, metadata)
    manifest: dict = {"step": 1, "hf": {"config": {"model_type": "llama"}}}
    if checksums:
        item = hashlib.sha256(bytes(16)).hexdigest()
        manifest["checksums"] = {
            "algorithm": "sha256",
            "metadata": hashlib.sha256(metadata).hexdigest(),
            "items": {"w@0": item, "model/w@0,0": item},
        }
    (tmp_path / "MANIFEST.json").write_text(json.dumps(manifest))
    return path


def test_export_refuses_crafted_sizes_before_allocating(tmp_path):
    """``shardkit export`` of a save whose manifest agrees with a crafted ``.metadata`` (a tensor of
    [2^20, 2^20]): a ShardkitError naming the file, not an allocator error."""
    from shardkit.checkpoint import export_hf

    save = tmp_path / "save"
    save.mkdir()
    crafted = _metadata((2**20, 2**20), (2**20, 2**20), offset=None, fqn="model/w")
    _manifest_save(save, pickle.dumps(crafted), checksums=True)
    start = time.perf_counter()
    with pytest.raises(ShardkitError, match=rf"{save}/\.metadata: tensor 'model/w'.*claims 1099511627776 elements"):
        export_hf(save, tmp_path / "out")
    assert time.perf_counter() - start < 10


def test_a_manifest_without_checksums_is_refused_unless_allowed(tmp_path):
    """Deleting ``checksums`` from a manifest no longer turns verification off with a warning:
    refused, naming the manifest and the flag; allowed (a save of an earlier release) it loads
    unverified, with the warning."""
    from shardkit.checkpoint.saves import open_save

    path = _manifest_save(tmp_path, pickle.dumps(_metadata(offset=None)), checksums=False)
    with pytest.raises(ShardkitError, match=r"MANIFEST.json has no checksums, .*refused.*--allow-unverified"):
        open_save(path)
    with pytest.warns(UserWarning, match=r"saved without checksums .* not verified"):
        manifest, _, reader = open_save(path, allow_unverified=True)
    assert manifest["step"] == 1 and reader is not None
