"""Hostile DCP ``.metadata`` files for tests (issue 31, finding 2), built from allow-listed classes
only: nothing in them runs code, they only cost work to whoever unpickles and hashes them.

One field of a valid metadata pickle (a storage index's ``offset``) is replaced by opcodes that
build a 100-level tuple DAG (``t = (t, t)``: hashing it visits 2^100 tuples with the GIL held) or
10^7 nested tuples. The splice works on protocol-2 pickles (no frames, so no lengths to fix).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

PLACEHOLDER = "SHARDKIT_SPLICE_HERE"
MARKER = b"X" + struct.pack("<I", len(PLACEHOLDER)) + PLACEHOLDER.encode()  # BINUNICODE of it


def dag_ops(levels: int) -> bytes:
    """``t = 0; t = (t, t)`` ``levels`` times: each level stores ``t`` in the memo and fetches it
    again (memo indexes far above the pickler's own)."""
    ops = b"K\x00"
    for i in range(levels):
        ops += b"r" + struct.pack("<I", 10**6 + i) + b"j" + struct.pack("<I", 10**6 + i) + b"\x86"
    return ops


def deep_ops(levels: int) -> bytes:
    """``(((0,),),)...``: TUPLE1 ``levels`` times."""
    return b"K\x00" + b"\x85" * levels


def spliced(md: Metadata, ops: bytes) -> bytes:
    """``md`` pickled (protocol 2) with its first storage index's offset replaced by what ``ops``
    push. The offset is set after the dict was built, so nothing hashes the placeholder."""
    index = next(iter(md.storage_data))
    object.__setattr__(index, "offset", PLACEHOLDER)
    data = pickle.dumps(md, protocol=2)
    assert data.count(MARKER) == 1
    return data.replace(MARKER, ops)


def plant(save: str, ops: bytes) -> None:
    """Replace the ``.metadata`` of the save directory ``save`` (one this test wrote) by its
    spliced copy, and rewrite the manifest's checksum of it to agree (an attacker can)."""
    md = FileSystemReader(save).read_metadata()
    data = spliced(md, ops)
    with open(os.path.join(save, ".metadata"), "wb") as f:
        f.write(data)
    path = os.path.join(save, "MANIFEST.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["checksums"]["metadata"] = hashlib.sha256(data).hexdigest()
    with open(path, "w") as f:
        json.dump(manifest, f)
