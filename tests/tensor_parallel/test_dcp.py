"""DCP sharded checkpoints of tensor-parallel models: saved at tp 4, loaded at tp 1, 2, 3, 4.

Each rank writes only the chunks it owns (checked in DCP's metadata); loads reshard through
DCP's chunk intersection and must give bitwise the saved parameters and the logits of the same
model sharded from full weights; a failed save leaves the previous checkpoint in place.
"""

import os

import pytest
import torch
import torch.distributed as dist
from hf_models import VOCAB, build

# Import transformers' modeling code before any collective (see test_checkpoint.py).
from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM  # noqa: E402, F401

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, subgroup, world_group
from shardkit.checkpoint import latest_checkpoint
from shardkit.checkpoint.chunks import ChunkSavePlanner
from shardkit.checkpoint.dcp import load_sharded_checkpoint, owned_ranges, save_sharded_checkpoint
from shardkit.checkpoint.reader import read_metadata
from shardkit.errors import ShardkitError
from shardkit.sharding import ShardSpec
from shardkit.tensor_parallel import apply_tp, gather_full_state_dict, shard_spec


def _shared_dir() -> str:
    return shared_tmpdir("shardkit_dcp_")


_cleanup = remove_shared_dir


def _listing(path: str) -> list[str]:
    """The saves and the pointer (rank 0 releases the root's lock, a dot file, on its own time)."""
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def _saved_model(kind: str):
    """A tp-4 model whose weights differ from build(kind)'s, and its full state."""
    model = apply_tp(build(kind, seed=5), world_group(), check="off")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    return model, gather_full_state_dict(model)


def test_owned_ranges_tile_the_full_tensor():
    """Pure: KV heads of 8 rows held by ranks [(0,8)], [(0,16)], [(8,16)], [(8,16)]; packed parts."""
    spec = ShardSpec(0, 16, (((0, 8),), ((0, 16),), ((8, 16),), ((8, 16),)), None)
    assert [owned_ranges(spec, r) for r in range(4)] == [[(0, 8, 0)], [(8, 16, 8)], [], []]
    packed = ShardSpec.packed(0, [[3, 2], [3, 2]], None)  # [G_r | U_r]
    assert [owned_ranges(packed, r) for r in range(2)] == [[(0, 3, 0), (5, 8, 3)], [(3, 5, 0), (8, 10, 2)]]


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_save_tp4_load_tp1_2_3_4(kind):
    path = _shared_dir()
    model, full = _saved_model(kind)
    save_sharded_checkpoint(model, path, world_group())
    groups = {1: [None], 2: [subgroup((0, 1)), subgroup((2, 3))], 3: [subgroup((0, 1, 2))], 4: [world_group()]}
    for tp, members, dcp_group in (
        (1, (0, 1, 2, 3), world_group()),
        (2, (0, 1, 2, 3), world_group()),
        (3, (0, 1, 2), subgroup((0, 1, 2))),
        (4, (0, 1, 2, 3), world_group()),
    ):
        if rank() not in members:
            continue  # rank 3 idles while ranks 0-2 load at tp 3
        tp_group = groups[tp][rank() // 2 if tp == 2 else 0]
        target, ref = build(kind), build(kind)
        ref.load_state_dict(full)
        if tp > 1:
            apply_tp(target, tp_group, check="off")
            apply_tp(ref, tp_group, check="off")
        load_sharded_checkpoint(target, path, dcp_group)
        got = gather_full_state_dict(target)
        assert got.keys() == full.keys() and all(torch.equal(got[n], full[n]) for n in full), tp
        with torch.no_grad():
            assert torch.equal(target(input_ids=_ids()).logits, ref(input_ids=_ids()).logits), tp
    _cleanup(path)


@pytest.mark.world(4, timeout=180)
def test_each_rank_writes_only_its_owned_chunks():
    """In DCP's metadata, the chunks of every sharded parameter are the owners' ranges and each
    sits in its owner's file; nothing (replicated tensors, shared KV heads) is stored twice."""
    path = _shared_dir()
    model, full = _saved_model("llama")
    version = save_sharded_checkpoint(model, path, world_group())
    md = read_metadata(version, None)
    for name, p in model.named_parameters():
        chunks = md.state_dict_metadata[name].chunks
        assert sum(c.sizes.numel() for c in chunks) == full[name].numel()
        spec = shard_spec(p)
        if spec is None:
            assert len(chunks) == 1
            continue
        for r in range(4):
            for a, _b, _ in owned_ranges(spec, r):
                (info,) = [v for k, v in md.storage_data.items() if k.fqn == name and k.offset[spec.dim] == a]
                assert info.relative_path.startswith(f"__{r}_"), (name, r, info.relative_path)
    _cleanup(path)


@pytest.mark.world(4, timeout=180)
def test_meta_model_loads_without_full_weights():
    path = _shared_dir()
    model, full = _saved_model("llama")
    save_sharded_checkpoint(model, path, world_group())
    group = [subgroup((0, 1)), subgroup((2, 3))][rank() // 2]  # new_group: every rank makes both
    with torch.device("meta"):
        target = build("llama")
    apply_tp(target, group, check="off")
    load_sharded_checkpoint(target, path, world_group())
    got = gather_full_state_dict(target)
    assert all(torch.equal(got[n], full[n]) for n in full)
    ref = build("llama")
    ref.load_state_dict(full)
    apply_tp(ref, group, check="off")
    with torch.no_grad():
        assert torch.equal(target(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)
    _cleanup(path)


@pytest.mark.world(4, timeout=180)
def test_failed_save_keeps_the_previous_checkpoint():
    """Rank 2 fails while writing: every rank raises, the old save stays the latest and loads;
    the next save removes the partial one."""
    base = _shared_dir()
    path = os.path.join(base, "ckpt")
    model, full = _saved_model("llama")
    first = save_sharded_checkpoint(model, path, world_group())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    original = ChunkSavePlanner.lookup_object

    def broken(self, index):
        raise OSError("disk full")

    if rank() == 2:
        ChunkSavePlanner.lookup_object = broken
    try:
        with pytest.raises(
            ShardkitError,
            match=r"save_sharded_checkpoint: writing .*version_00000002 failed: "
            r"rank 2: OSError: disk full$",
        ):
            save_sharded_checkpoint(model, path, world_group())
    finally:
        ChunkSavePlanner.lookup_object = original
    assert latest_checkpoint(path) == first
    assert _listing(path) == ["latest", "version_00000001", "version_00000002"]  # 2: partial
    if rank() == 0:
        with open(os.path.join(base, "notes.txt"), "w") as f:
            f.write("user data")
    dist.barrier()
    with pytest.raises(ShardkitError, match="holds files that are not checkpoint saves"):
        save_sharded_checkpoint(model, base, world_group())  # would mix with the user's directory
    target = apply_tp(build("llama"), world_group(), check="off")
    load_sharded_checkpoint(target, path, world_group())
    got = gather_full_state_dict(target)
    assert all(torch.equal(got[n], full[n]) for n in full)
    if rank() == 0:  # what a commit killed before its os.replace leaves
        open(os.path.join(path, "latest.tmp-999"), "w").close()
    dist.barrier()
    third = save_sharded_checkpoint(model, path, world_group())  # keep=1: the partial, the first, the tmp go
    assert os.path.basename(third) == "version_00000003" and latest_checkpoint(path) == third
    dist.barrier()
    assert _listing(path) == ["latest", "version_00000003"]
    load_sharded_checkpoint(target, path, world_group())
    got = gather_full_state_dict(target)
    assert all(torch.equal(got[n], 3.0 * full[n]) for n in full)
    _cleanup(base)


@pytest.mark.world(2, timeout=180)
def test_load_mismatch_raises_on_every_rank():
    path = _shared_dir()
    model = apply_tp(build("llama"), world_group(), check="off")
    save_sharded_checkpoint(model, path, world_group())
    other = apply_tp(build("qwen3"), world_group(), check="off")  # q_norm / k_norm not in a llama checkpoint
    with pytest.raises(
        ShardkitError, match=r"ranks 0, 1: .*not in the checkpoint: .*model.layers.0.self_attn.k_norm.weight"
    ):
        load_sharded_checkpoint(other, path, world_group())
    with pytest.raises(ShardkitError, match="cannot read a DCP checkpoint"):
        load_sharded_checkpoint(other, os.path.join(path, "absent"), world_group())
    # the other way round: the checkpoint's q_norm / k_norm are in no rank's model
    save_sharded_checkpoint(other, path, world_group())
    with pytest.raises(ShardkitError, match=r"key\(s\) of the checkpoint are in no rank's model: .*q_norm"):
        load_sharded_checkpoint(apply_tp(build("llama"), world_group(), check="off"), path, world_group())
    _cleanup(path)


@pytest.mark.world(2, timeout=180)
def test_float32_checkpoint_into_bfloat16_model_raises_instead_of_casting():
    path = _shared_dir()
    model = apply_tp(build("llama").float(), world_group(), check="off")
    save_sharded_checkpoint(model, path, world_group())
    target = apply_tp(build("llama").to(torch.bfloat16), world_group(), check="off")
    before = {n: p.clone() for n, p in target.named_parameters()}
    with pytest.raises(
        ShardkitError,
        match=r"ranks 0, 1: dtypes differ.*model.embed_tokens.weight \(checkpoint float32, model bfloat16\)",
    ):
        load_sharded_checkpoint(target, path, world_group())
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())  # nothing was read
    _cleanup(path)


def _metadata(fqn="w", relative_path="__0_0.distcp", bytes_item=False):
    """A DCP Metadata of one float32 tensor [2] (or a bytes item), as DCP pickles it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    entry = (
        BytesStorageMetadata()
        if bytes_item
        else TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([2]),
            [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))],
        )
    )
    return Metadata(
        state_dict_metadata={fqn: entry},
        storage_data={MetadataIndex(fqn, torch.Size([0])): _StorageInfo(relative_path, 0, 10)},
    )


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "code",
            r"names the global (posix|os)\.system, which a checkpoint's metadata never holds \(refused, nothing of "
            r"it was run\)",
        ),
        ("code inside", r"names the global (posix|os)\.system"),
        ("bytes item", r"holds pickled \(non-tensor\) items \['w'\], which shardkit never writes"),
        ("path outside", r"item 'w' is stored at '\.\./elsewhere.distcp', not a plain file of the save's directory"),
        ("truncated", r"\.metadata is truncated or not a DCP metadata file"),
        ("another hash", r"\.metadata differs from the save's manifest \(SHA-256 mismatch\)"),
    ],
)
def test_metadata_is_read_through_the_allow_list(tmp_path, case, message):
    """DCP's pickled .metadata: its own classes, sizes and dtypes load; any other global is
    refused before it is looked up (the planted command never runs), as are bytes items (DCP
    would torch.load them with weights_only=False) and items outside the save's directory."""
    import pickle

    from shardkit.checkpoint.reader import read_metadata

    marker = tmp_path / "ran"
    good = pickle.dumps(_metadata())
    data = {
        "code": pickle.dumps(_RunsCode(marker)),
        "code inside": pickle.dumps({"metadata": _metadata(), "extra": _RunsCode(marker)}),
        "bytes item": pickle.dumps(_metadata(bytes_item=True)),
        "path outside": pickle.dumps(_metadata(relative_path="../elsewhere.distcp")),
        "truncated": good[: len(good) // 2],
        "another hash": good,
    }[case]
    (tmp_path / ".metadata").write_bytes(data)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(10))  # the bytes _metadata() says it stores
    with pytest.raises(ShardkitError, match=message):
        read_metadata(str(tmp_path), "0" * 64 if case == "another hash" else None)
    assert not marker.exists()
    (tmp_path / ".metadata").write_bytes(good)
    md = read_metadata(str(tmp_path), None)
    assert list(md.state_dict_metadata) == ["w"] and md.state_dict_metadata["w"].properties.dtype == torch.float32


@pytest.mark.world(2, timeout=180)
def test_load_sharded_checkpoint_verifies_what_it_reads():
    """The library's own loader shares the trainer's checks: a planted .metadata is refused
    unrun; a save without checksums (an older shardkit) is refused, and loads unverified with a
    warning only when allowed (``allow_unverified``); damaged
    checksums are refused."""
    import hashlib
    import json
    import pickle

    from shardkit.checkpoint import MANIFEST

    path = _shared_dir()
    marker = path + "-ran"
    model = apply_tp(build("llama"), world_group(), check="off")
    version = save_sharded_checkpoint(model, path, world_group())
    metadata = os.path.join(version, ".metadata")
    good = open(metadata, "rb").read()

    def plant():
        with open(metadata, "wb") as f:
            pickle.dump(_RunsCode(marker), f)
        manifest = json.load(open(os.path.join(version, MANIFEST)))
        manifest["checksums"]["metadata"] = hashlib.sha256(open(metadata, "rb").read()).hexdigest()
        json.dump(manifest, open(os.path.join(version, MANIFEST), "w"))

    if rank() == 0:
        plant()
    dist.barrier()
    with pytest.raises(
        ShardkitError,
        match=r"load_sharded_checkpoint: checkpoint refused .* ranks 0, 1: cannot read a "
        r"DCP checkpoint .*names the global (posix|os)\.system",
    ):
        load_sharded_checkpoint(model, path, world_group())
    assert not os.path.exists(marker)
    dist.barrier()
    if rank() == 0:  # the right metadata back, and a manifest of an older shardkit (no checksums)
        open(metadata, "wb").write(good)
        manifest = json.load(open(os.path.join(version, MANIFEST)))
        del manifest["checksums"]
        json.dump(manifest, open(os.path.join(version, MANIFEST), "w"))
    dist.barrier()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with pytest.raises(ShardkitError, match=r"MANIFEST.json has no checksums, .* refused.* --allow-unverified"):
        load_sharded_checkpoint(model, path, world_group())  # deleting the checksums turns nothing off
    with pytest.warns(UserWarning, match=r"saved without checksums .* not verified"):
        load_sharded_checkpoint(model, path, world_group(), allow_unverified=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    dist.barrier()
    if rank() == 0:  # checksums present but damaged: refused, not taken for an older save
        manifest = json.load(open(os.path.join(version, MANIFEST)))
        manifest["checksums"] = "garbage"
        json.dump(manifest, open(os.path.join(version, MANIFEST), "w"))
    dist.barrier()
    with pytest.raises(ShardkitError, match=r"MANIFEST.json has damaged checksums: the save cannot be verified"):
        load_sharded_checkpoint(model, path, world_group())
    _cleanup(path)


def test_saved_entries_is_a_deprecated_alias_that_reads_through_the_allow_list(tmp_path, monkeypatch):
    """The old ``saved_entries(path)`` still answers (one release), warns, and never runs a pickle."""
    import pickle
    import sys

    # An earlier test may have imported the old name already (the warning is given once per import).
    monkeypatch.delitem(sys.modules, "shardkit.tensor_parallel.dcp", raising=False)
    with pytest.warns(
        DeprecationWarning, match="shardkit.tensor_parallel.dcp is deprecated: import shardkit.checkpoint.dcp"
    ):
        from shardkit.tensor_parallel.dcp import saved_entries

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_metadata()))
    (tmp_path / "__0_0.distcp").write_bytes(bytes(10))
    with pytest.warns(DeprecationWarning, match="saved_entries is deprecated"):
        entries = saved_entries(str(tmp_path))
    assert entries == {"w": (tuple(_metadata().state_dict_metadata["w"].size), torch.float32)}
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.warns(DeprecationWarning), pytest.raises(ShardkitError, match="names the global"):
        saved_entries(str(tmp_path))
    assert not marker.exists()
