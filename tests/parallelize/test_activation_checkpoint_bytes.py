"""Saved-activation bytes per decoder block (:class:`~shardkit.parallelize.saved_bytes.SavedBytesMeter`).

The table: bytes one block keeps for backward under ``none``, ``full`` and ``selective`` at tp 1
and 2 (sequence parallel) and cp 1 and 2 (Ulysses), tiny float64 Llama (H 32, 4 heads of D 8,
S 8, 2 rows per rank). ``full`` keeps only the block's inputs, so its count follows from the
shapes: hidden states ``[B, S / (cp tp), H]``, rotary cos and sin ``[1 or B, S / cp, D]`` each,
position ids ``[1 or B, S / cp]`` (int64). ``selective`` keeps those plus the matmul, attention
and collective outputs; ``none`` every tensor autograd saves. ``full`` is the least everywhere;
``selective`` is below ``none`` too (see :data:`LAYOUTS`). The figures are printed for the
planner's memory model (``pytest -s``).
"""

from __future__ import annotations

import pytest

from harness.helpers import all_true, rank
from harness.tiny_lm import SIZES, tiny_decoder, token_ids
from shardkit.parallelize import decoder_layers, parallelize
from shardkit.parallelize.saved_bytes import SavedBytesMeter
from shardkit.sharding import ParallelDims

ROWS = 2  # batch rows per data-parallel rank
H, D, S = SIZES["hidden_size"], SIZES["hidden_size"] // SIZES["heads"], SIZES["seq_len"]

# layout -> whether selective keeps less than none. It does everywhere since the selective policy
# recomputes the output projections (o_proj, down_proj): before, at tp 2 x cp 2 it kept 23200
# bytes against none's 22208 (their H-wide outputs and the Ulysses results beside the q / k / v
# projections).
LAYOUTS = {
    "tp=1, cp=1": (dict(dp_replicate=4), True),
    "tp=2, cp=1": (dict(tp=2, dp_replicate=2), True),
    "tp=1, cp=2": (dict(cp_ulysses=2, dp_replicate=2), True),
    "tp=2, cp=2": (dict(tp=2, cp_ulysses=2), True),
}


def _per_block(layout: dict, mode: str) -> tuple[list[int], int]:
    """Bytes each block kept, and the full-mode count from the shapes of block 0's inputs."""
    mesh = ParallelDims(**layout).build_mesh("cpu")
    pm = parallelize(tiny_decoder(), mesh, sequence_parallel=mesh.size("tp") > 1, activation_checkpoint=mode)
    ids = token_ids(ROWS * mesh.size("dp"))[mesh.local_rank("dp") * ROWS :][:ROWS]
    inputs = pm.cp.shard_batch(ids, ids).inputs if pm.cp is not None else dict(input_ids=ids)
    blocks = decoder_layers(pm.module)
    shapes: list = []
    blocks[0].register_forward_pre_hook(lambda m, a, k: shapes.append((a, k)), with_kwargs=True)
    with SavedBytesMeter(blocks, mode) as meter:
        out = pm.module(**inputs).logits
    out.pow(2).sum().backward()
    args, kwargs = shapes[0]
    hidden = (args[0] if args else kwargs["hidden_states"]).shape
    cos, sin = kwargs["position_embeddings"]
    positions = kwargs["position_ids"]
    tp, cp = mesh.size("tp"), mesh.size("cp")
    assert tuple(hidden) == (ROWS, S // (cp * tp), H) and cos.shape[-2:] == (S // cp, D)
    expected = 8 * (ROWS * S // (cp * tp) * H + 2 * cos.numel() + positions.numel())
    return meter.per_block, expected


@pytest.mark.world(4, timeout=120)
@pytest.mark.parametrize("layout,selective_below_none", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_saved_bytes_full_below_selective_below_none(layout, selective_below_none):
    table = {mode: _per_block(layout, mode) for mode in ("none", "full", "selective")}
    (none, _), (full, expected), (selective, _) = table["none"], table["full"], table["selective"]
    if rank() == 0:
        print(f"\n{layout}: bytes per block none {none[0]}, selective {selective[0]}, full {full[0]}")
    ok = all(f == expected for f in full) and all(f < s and f < n for f, s, n in zip(full, selective, none))
    ok &= all((s < n) == selective_below_none for s, n in zip(selective, none))
    ok &= len(set(none)) == 1 and all(n > 0 for n in none)  # identical blocks keep the same
    assert all_true(ok), (none, selective, full, expected)


@pytest.mark.world(4, timeout=60)
def test_saved_bytes_leave_out_the_weights_a_nested_fsdp2_module_gathers():
    # experts FSDP2-sharded over edp are gathered inside the block, after its pre-hook: the linear's
    # saved weight is that gathered parameter, not an activation; only the input counts
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(H, H, bias=False, dtype=torch.float64)

        def forward(self, x):
            return self.inner(x)

    block = Block()
    fully_shard(block.inner, mesh=init_device_mesh("cpu", (4,)))
    x = torch.randn(ROWS, S, H, dtype=torch.float64, requires_grad=True)
    with SavedBytesMeter([block], "none") as meter:
        y = block(x)
    y.sum().backward()
    assert all_true(meter.per_block == [x.nbytes]), meter.per_block
