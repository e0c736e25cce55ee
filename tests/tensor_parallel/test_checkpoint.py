"""load_sharded: Hugging Face safetensors checkpoints read slice by slice into tensor-parallel models.

Models are built on the meta device and never exist in full on a rank. Checks (docs/design.md,
Testing): the gathered parameters equal the checkpoint bitwise; logits (and gradients, so the
replicated-head hooks survive materialization) equal those of the same model sharded by
``apply_tp`` from full weights, bitwise; each rank reads exactly the bytes of its own shards plus
the replicated tensors; bad checkpoints raise on every rank.
"""

import os

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from hf_models import VOCAB, build
from torch import nn

# Import transformers' modeling code when a rank loads this module, before any collective: on a
# busy machine the first import can outlast the test process group's timeout.
from transformers import (  # noqa: E402, F401
    DeepseekV2ForCausalLM,
    LlamaForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, subgroup, world_group
from shardkit.checkpoint import SafetensorsCheckpoint, load_sharded
from shardkit.errors import ShardkitError
from shardkit.tensor_parallel import apply_tp, gather_full_grads, gather_full_state_dict, shard_spec


def _shared_dir() -> str:
    return shared_tmpdir("shardkit_ckpt_")


_cleanup = remove_shared_dir


def _meta(kind: str):
    with torch.device("meta"):  # rotary inv_freq and every parameter land on meta
        return build(kind)


def _ids():
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))


def _step(model):
    out = model(input_ids=_ids(), labels=_ids())
    out.loss.backward()
    return out.logits.detach()


def _save_hf(kind: str, path: str, **kwargs) -> None:
    model = build(kind)  # on every rank: the first build imports transformers' modeling code (slow)
    if rank() == 0:
        model.save_pretrained(path, **kwargs)
    dist.barrier()


def _same_as_sharded_reference(model, kind: str, group) -> None:
    """Bitwise: gathered weights == build(kind); logits and gathered grads == apply_tp(build(kind))."""
    ref_full = build(kind)
    ref = apply_tp(build(kind), group, check="off")
    full = gather_full_state_dict(model)
    assert all(torch.equal(full[n], p) for n, p in ref_full.named_parameters())
    assert torch.equal(_step(model), _step(ref))
    grads, ref_grads = gather_full_grads(model), gather_full_grads(ref)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v2"])
def test_load_sharded_from_save_pretrained(kind):
    """save_pretrained output (MoE experts written per expert by transformers 5; DeepSeek-V2 in
    index + shards) loads at tp 4 (uneven heads, replicated KV heads)."""
    path = _shared_dir()
    _save_hf(kind, path, **({"max_shard_size": "20KB"} if kind == "deepseek_v2" else {}))
    if kind == "deepseek_v2":
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model = load_sharded(_meta(kind), path, world_group(), check="off")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    _same_as_sharded_reference(model, kind, world_group())
    _cleanup(path)


@pytest.mark.world(4, timeout=180)
def test_each_rank_reads_only_its_slices():
    """Each rank reads exactly its local tensors' bytes; over the ranks, the sharded weights are
    read once plus the rows of KV heads held by several ranks; replicated tensors once per rank."""
    path = _shared_dir()
    _save_hf("llama", path)
    with SafetensorsCheckpoint(path) as ckpt:
        model = load_sharded(_meta("llama"), ckpt, world_group(), check="off")
        read = ckpt.bytes_read
    params = list(model.parameters())
    local = sum(p.numel() * p.element_size() for p in params)
    replicated = sum(p.numel() * p.element_size() for p in params if shard_spec(p) is None)
    assert read == local
    full = {n: t for n, t in build("llama").named_parameters()}
    sharded_full = sum(full[n].numel() * 8 for n, p in model.named_parameters() if shard_spec(p) is not None)
    extra = 0  # rows of replicated KV heads beyond their first holder
    for n, p in model.named_parameters():
        spec = shard_spec(p)
        if spec is not None and spec.overlapping:
            extra += (sum(spec.sizes) - spec.full_size) * (full[n].numel() // spec.full_size) * 8
    total = torch.tensor([read - replicated], dtype=torch.int64)
    dist.all_reduce(total)
    assert total.item() == sharded_full + extra
    file_bytes = sum(t.numel() * 8 for t in full.values())
    assert read < 0.45 * file_bytes  # tp 4: about 1/4 of the weights plus the small replicated norms
    _cleanup(path)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("fmt", ["safetensors", "save_pretrained"])
def test_round_trip_to_other_tp_sizes(kind, fmt):
    """Saved at tp 4 from gathered full tensors (packed parts repacked), loaded at tp 2 (two
    replicas), tp 3 (ranks 0-2) and tp 1 (rank 3): bitwise parameters and logits."""
    path = _shared_dir()
    model = apply_tp(build(kind, seed=5), world_group(), check="off")
    with torch.no_grad():  # make the saved weights differ from build(kind)'s
        for p in model.parameters():
            p.add_(0.25)
    full = gather_full_state_dict(model)
    if rank() == 0:
        if fmt == "safetensors":  # fused expert keys, as the model names them
            safetensors.torch.save_file(
                {k: v.contiguous() for k, v in full.items()},
                os.path.join(path, "model.safetensors"),
                metadata={"format": "pt"},
            )
        else:  # transformers 5 writes experts per expert; it empties the dict it is given
            model.save_pretrained(path, state_dict=dict(full), max_shard_size="30KB")
    dist.barrier()
    groups = {2: [subgroup((0, 1)), subgroup((2, 3))], 3: [subgroup((0, 1, 2))], 1: [subgroup((3,))]}
    for tp, r in ((2, rank() // 2), (3, 0), (1, 0)):
        members = [(0, 1), (2, 3)][r] if tp == 2 else ((0, 1, 2) if tp == 3 else (3,))
        if rank() not in members:
            continue
        group = groups[tp][r]
        loaded = load_sharded(_meta(kind), path, group, check="off")
        got = gather_full_state_dict(loaded)
        assert got.keys() == full.keys() and all(torch.equal(got[n], full[n]) for n in full)
        ref = build(kind)
        ref.load_state_dict(full)
        apply_tp(ref, group, check="off")
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)
    _cleanup(path)


@pytest.mark.world(2, timeout=180)
def test_missing_unexpected_shape_and_dtype_mismatch_raise_on_every_rank():
    path = _shared_dir()
    if rank() == 0:
        state = {k: v.contiguous() for k, v in build("llama").state_dict().items()}
        state.pop("model.layers.1.mlp.up_proj.weight")
        state["model.norm.weight"] = torch.ones(47, dtype=torch.float64)
        norm = "model.layers.0.input_layernorm.weight"
        state[norm] = state[norm].float()  # a float32 tensor for a float64 model: never cast
        state["model.layers.9.mlp.up_proj.weight"] = torch.ones(2, dtype=torch.float64)  # no such layer
        safetensors.torch.save_file(state, os.path.join(path, "model.safetensors"))
    dist.barrier()
    model = _meta("llama")
    with pytest.raises(ShardkitError) as info:
        load_sharded(model, path, world_group(), check="off")
    msg = str(info.value)
    assert "ranks 0, 1: 1 key(s) of the model are not in the checkpoint: model.layers.1.mlp.up_proj.weight" in msg
    assert "model.norm.weight (checkpoint [47], model [48])" in msg
    assert "model.layers.0.input_layernorm.weight (checkpoint float32, model float64)" in msg
    assert "key(s) of the checkpoint are in no rank's model: model.layers.9.mlp.up_proj.weight" in msg
    assert shard_spec(model.model.layers[0].self_attn.q_proj.weight) is None  # not sharded yet
    _cleanup(path)


@pytest.mark.world(2, timeout=180)
def test_error_on_one_rank_raises_on_all():
    """Rank 1 sees no checkpoint (e.g. an unshared disk): both ranks raise, none hangs."""
    path = _shared_dir()
    _save_hf("llama", path)
    mine = path if rank() == 0 else os.path.join(path, "absent")
    with pytest.raises(ShardkitError, match=r"rank 1: load_sharded: no checkpoint at"):
        load_sharded(_meta("llama"), mine, world_group(), check="off")
    _cleanup(path)


class _Scaled(nn.Module):
    """A user module with a non-persistent buffer computed at construction."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.up = nn.Linear(n, 2 * n, dtype=torch.float64)
        self.down = nn.Linear(2 * n, n, dtype=torch.float64)
        self.register_buffer("scale", torch.linspace(1, 2, n, dtype=torch.float64), persistent=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) * self.scale


@pytest.mark.world(2, timeout=180)
def test_user_model_buffers_need_init_buffers():
    path = _shared_dir()
    torch.manual_seed(0)
    ref = _Scaled(5)
    if rank() == 0:
        safetensors.torch.save_file(ref.state_dict(), os.path.join(path, "model.safetensors"))
    dist.barrier()
    plan = {"up": "colwise", "down": "rowwise"}
    with torch.device("meta"):
        model = _Scaled(5)
    with pytest.raises(ShardkitError, match="pass init_buffers"):
        load_sharded(model, path, world_group(), plan)
    with torch.device("meta"):
        model = _Scaled(5)

    def init(module):
        module.scale.copy_(torch.linspace(1, 2, 5, dtype=torch.float64))

    load_sharded(model, path, world_group(), plan, init_buffers=init)
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(x), ref(x), rtol=1e-12, atol=0)
    with torch.device("meta"):
        model = _Scaled(5)
    with pytest.raises(ShardkitError, match="left these buffers uninitialized"):
        load_sharded(model, path, world_group(), plan, init_buffers=lambda m: None)
    _cleanup(path)
