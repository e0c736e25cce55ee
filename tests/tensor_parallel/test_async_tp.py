"""``apply_tp(..., sequence_parallel=True, async_tp=True)``: the sequence all-gathers and
reduce-scatters issued as collective-matmul rings (``shardkit.comm.collective_matmul``).

Parity (docs/design.md, Testing): float64 logits, loss and every parameter gradient against the
unsharded model (so against the synchronous SP path, which passes the same test), tp 2 and 4,
sequence lengths no tp size divides (and 3 over 4 ranks: a rank without tokens), both
``sp_activation`` layouts; Qwen2 (q/k/v biases inside the ring), Qwen3 (q/k norms after the
ring's outputs) and DeepSeek-V2 (MLA: a replicated reader of the gathered input beside q_proj).
The ledger: no whole sequence all-gather or reduce-scatter of a block is left, only ring steps.
"""

import pytest
from hf_models import assert_parity
from hf_models import build as _build
from hf_models import ids as _ids

from harness.helpers import world_group, world_size
from shardkit import CommLedger, ShardkitError
from shardkit.tensor_parallel import apply_tp

RTOL = 1e-9


def _parity(kind, seq, sp_activation="shard"):
    ref, model = _build(kind), _build(kind)
    apply_tp(model, world_group(), check="off", sequence_parallel=True, async_tp=True, sp_activation=sp_activation)
    assert_parity(ref, model, _ids(seq=seq), RTOL)
    return model


@pytest.mark.world(2)
@pytest.mark.combinations
@pytest.mark.parametrize("kind,seq,act", [("llama", 7, "shard"), ("qwen2", 8, "gathered"), ("deepseek_v2", 7, "shard")])
def test_async_tp_parity_tp2(kind, seq, act):
    _parity(kind, seq, act)


@pytest.mark.world(4)
@pytest.mark.combinations
@pytest.mark.parametrize("kind,seq,act", [("llama", 7, "gathered"), ("qwen3", 3, "shard"), ("llama", 8, "shard")])
def test_async_tp_parity_tp4(kind, seq, act):
    """seq 3 over 4 ranks: blocks [1, 1, 1, 0]; the empty block is never sent."""
    _parity(kind, seq, act)


@pytest.mark.world(2)
def test_async_tp_issues_rings_not_whole_collectives():
    """Per layer and microbatch: two gather rings (attention's q/k/v, the MLP's gate/up) and two
    reduce-scatter rings (o_proj, down_proj), plus the head's gather ring; each ring R - 1 sends of
    one sequence block. A whole all-gather or reduce-scatter of a block fails this."""
    model = _build("llama")
    apply_tp(model, world_group(), check="off", sequence_parallel=True, async_tp=True, sp_activation="shard")
    ids = _ids(seq=8)
    R, L, H = world_size(), len(model.model.layers), model.config.hidden_size
    with CommLedger() as fwd:
        out = model(input_ids=ids, labels=ids)
    with CommLedger() as bwd:
        out.loss.backward()
    for ledger in (fwd, bwd):
        assert ledger.count(api="all_gather") == ledger.count(api="reduce_scatter") == 0, ledger.summary()
        assert ledger.count(api="sp_regather", op="all_gather_single") == 0
    block = 2 * 8 // R * H * 8  # [B, S / R, H] float64
    assert fwd.count(op="send", api="all_gather_matmul") == (2 * L + 1) * (R - 1)
    assert fwd.count(op="send", api="matmul_reduce_scatter") == 2 * L * (R - 1)
    assert fwd.bytes_sent(op="send") == (4 * L + 1) * (R - 1) * block
    assert fwd.count(op="recv") == fwd.count(op="send")
    assert bwd.count(op="send", api="all_gather_matmul", phase="backward") == (2 * L + 1) * (R - 1)
    assert bwd.count(op="send", api="sp_regather", phase="recompute") == (2 * L + 1) * (R - 1)
    assert bwd.count(op="send", api="matmul_reduce_scatter", phase="backward") == 2 * L * (R - 1)
    assert bwd.bytes_sent(op="send") == (6 * L + 2) * (R - 1) * block


@pytest.mark.world(2)
def test_async_tp_needs_sequence_parallel():
    with pytest.raises(ShardkitError, match="async_tp=True needs sequence_parallel"):
        apply_tp(_build("llama"), world_group(), check="off", async_tp=True)
