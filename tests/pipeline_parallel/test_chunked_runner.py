"""The runner on virtual stages: every schedule of SCHEDULES executed on p ranks of v chunks.

Every rank builds the full float64 MLP from one seed, keeps its chunks (:func:`chunk_layers`:
9 layers over p * v chunks, uneven) and compares the losses (the rank holding the last chunk)
and its chunks' parameter gradients with one process's backprop of the mean microbatch loss
(1e-12). Microbatches differ in sequence length, so every channel negotiates shapes.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from harness.helpers import all_true, get_mesh, rank, world_group, world_size
from harness.pipe_models import mlp_chunks, mse, tanh_mlp
from shardkit.comm import CommLedger
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import ChunkedStage, PipelineStage, chunk_layers, run_schedule, split_microbatches
from shardkit.pipeline_parallel._fsdp_steps import last_backwards
from shardkit.pipeline_parallel._mailbox import link_groups, links_error
from shardkit.pipeline_parallel.simulate import fifo_mismatches, transfers
from shardkit.pipeline_parallel.steps import Step
from shardkit.pipeline_parallel.tables import SCHEDULES, schedule_table

H, LAYERS = 4, 9
# (schedule, v): v in each schedule's allowed set; looped-bfs also at v = 1
CASES = [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("looped-bfs", 1), ("looped-bfs", 2)]
CASES += [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2), ("interleaved-zb", 2)]


def _model():
    return tanh_mlp(H, LAYERS, seed=4321)


def _chunks(model, p, v, placement, r):
    return mlp_chunks(model, LAYERS, p, v, placement, r)


def _data(m, varlen):
    gen = torch.Generator().manual_seed(7)
    lens = [2 + (m_ % 3 if varlen else 0) for m_ in range(m)]
    xs = [torch.randn(2, s, H, generator=gen, dtype=torch.float64) for s in lens]
    ts = [torch.randn(2, s, H, generator=gen, dtype=torch.float64) for s in lens]
    return xs, ts


def _close(a, b):
    return a is not None and torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def _parity(name, v, m, varlen=True):
    r, p, g = rank(), world_size(), world_group()
    placement = SCHEDULES[name].placement
    full = _model()
    xs, ts = _data(m, varlen)
    full.zero_grad()
    ref_losses = [mse(full(x), t) for x, t in zip(xs, ts)]
    (sum(ref_losses) / m).backward()
    mine = copy.deepcopy(_chunks(full, p, v, placement, r))
    for mod in mine:
        mod.zero_grad()
    stage = PipelineStage(mine, g, loss_fn=mse, placement=placement)
    losses = run_schedule(stage, name, xs, ts, num_microbatches=m)
    ok = True
    if stage.holds(p * v - 1):
        ok &= len(losses) == m and all(_close(a, b.detach()) for a, b in zip(losses, ref_losses))
    else:
        ok &= losses is None
    for mod, ref in zip(mine, _chunks(full, p, v, placement, r), strict=True):
        for a, b in zip(mod.parameters(), ref.parameters(), strict=True):
            ok &= _close(a.grad, b.grad)
    assert all_true(ok), (name, v, r)


@pytest.mark.world(2, timeout=60)
@pytest.mark.parametrize(("name", "v"), CASES)
def test_parity_p2_every_schedule(name, v):
    _parity(name, v, m=4)


@pytest.mark.world(4, timeout=90)
@pytest.mark.parametrize(("name", "v"), CASES)
def test_parity_p4_every_schedule(name, v):
    _parity(name, v, m=8)


@pytest.mark.world(2, timeout=60)
def test_v_table_with_fifo_mismatch_runs_and_equals_full_batch_backprop():
    """zbv at p = 2, m = 4: a receiver needs messages in another order than they are sent (the
    simulator's finding); the runner posts receives in the sender's order and still matches the
    full-batch reference (one batch split into equal microbatches)."""
    assert fifo_mismatches(schedule_table("zbv", 2, 2, 4), placement="v", v=2)
    r, p, g = rank(), world_size(), world_group()
    full = _model()
    gen = torch.Generator().manual_seed(3)
    x, t = (torch.randn(8, 3, H, generator=gen, dtype=torch.float64) for _ in range(2))
    full.zero_grad()
    ref = mse(full(x), t)
    ref.backward()
    mine = copy.deepcopy(_chunks(full, p, 2, "v", r))
    stage = PipelineStage(mine, g, loss_fn=mse, placement="v")
    losses = run_schedule(stage, "zbv", split_microbatches(x, 4), split_microbatches(t, 4), num_microbatches=4)
    ok = r != 0 or _close(torch.stack(losses).mean(), ref.detach())
    for mod, refmod in zip(mine, _chunks(full, p, 2, "v", r), strict=True):
        for a, b in zip(mod.parameters(), refmod.parameters(), strict=True):
            ok &= _close(a.grad, b.grad)
    assert all_true(ok)


@pytest.mark.world(2, timeout=60)
def test_local_handover_and_shape_caches_kept_across_calls():
    """V placement on p = 2: chunk 1 -> 2 stays on rank 1 (no P2P for it: rank 1 sends exactly the
    messages of the table's cross-rank transfers). A second call with the same shapes sends one
    message per transfer (the shape caches are kept); both calls match the reference."""
    r, p, g = rank(), world_size(), world_group()
    table = schedule_table("dualpipev", p, 2, 4)
    full = _model()
    mine = copy.deepcopy(_chunks(full, p, 2, "v", r))
    stage = PipelineStage(mine, g, loss_fn=mse, placement="v")
    xs, ts = _data(4, varlen=False)
    counts, apis = [], {}
    for _ in range(2):
        with CommLedger() as ledger:
            run_schedule(stage, table, xs, ts)
        counts.append(sum(1 for rec in ledger.records if rec.op == "send"))
        apis = {
            (a, ph): ledger.count(op="send", api=a, phase=ph) for a, ph in {(r.api, r.phase) for r in ledger.records}
        }
    # The table's cross-rank transfers from this rank (none for the local chunk 1 -> 2); shapes
    # are cached per (direction, receiving chunk): each key's first transfer of the first call
    # negotiates (header, payload), every other one is one packed message.
    sent = transfers(table, placement="v", v=2)[0][(r, 1 - r)]
    keys = {(d, c) for d, _, c in sent}
    ok = len(sent) == 8 and all(c != 2 for d, _, c in sent if d == "F")
    # activations are forward traffic and gradients backward, whichever neighbour they go to
    n_f = sum(d == "F" for d, _, _ in sent)
    ok &= apis.get(("send_forward", "forward")) == n_f and apis.get(("send_backward", "backward")) == 8 - n_f
    assert all_true(ok and counts == [len(sent) + len(keys), len(sent)]), counts


@pytest.mark.world(2, timeout=60)
def test_table_that_does_not_fit_the_chunks_raises_on_every_rank():
    r, g = rank(), world_group()
    stage = PipelineStage([nn.Identity(), nn.Identity()], g, loss_fn=mse)  # v = 2, looped
    xs, ts = _data(2, varlen=False)
    one_chunk = schedule_table("1f1b", 2, 1, 2)  # chunk 1 never runs
    with pytest.raises(ShardkitError, match="cannot run on 2 ranks x 2 chunks"):
        run_schedule(stage, one_chunk, xs, ts)
    with pytest.raises(ShardkitError, match="places chunks 'v'"):
        run_schedule(stage, "zbv", xs, ts, num_microbatches=2)
    with pytest.raises(ShardkitError, match="v .chunks per rank. must be 1"):
        run_schedule(stage, "zb-h1", xs, ts, num_microbatches=2)
    wrong = schedule_table("looped-bfs" if r == 0 else "interleaved-1f1b", 2, 2, 2)  # valid, but not the same
    with pytest.raises(ShardkitError, match="another schedule table"):
        run_schedule(stage, wrong, xs, ts)
    with pytest.raises(ShardkitError, match="needs 2 targets_microbatches"):
        run_schedule(stage, "looped-bfs", xs, ts[:1] if r == 1 else ts, num_microbatches=2)


@pytest.mark.world(2, timeout=60)
def test_chunked_stage_refuses_bad_arguments_on_every_rank():
    g = world_group()
    with pytest.raises(ShardkitError, match="placement 'v' holds 2 chunks"):
        PipelineStage([nn.Identity()] * 3, g, loss_fn=mse, placement="v")
    with pytest.raises(ShardkitError, match=r"rank 1 has \(v, placement\)"):
        PipelineStage([nn.Identity()] * (1 + rank()), g, loss_fn=mse)
    with pytest.raises(ShardkitError, match="needs loss_fn"):
        PipelineStage([nn.Identity()], g)
    with pytest.raises(ShardkitError, match="stage_index=0 but this rank is group rank 1"):
        PipelineStage([nn.Identity()], g, 0, 2, loss_fn=mse)  # a list with indices: checked as one module


@pytest.mark.world(2, timeout=60)
def test_chunked_stage_is_a_deprecated_alias_of_pipeline_stage():
    """``ChunkedStage(modules, group, placement=, loss_fn=)`` warns, naming the replacement, and
    builds a :class:`PipelineStage` whose run equals one built directly (bitwise)."""
    r, g = rank(), world_group()
    full = _model()
    mine = _chunks(full, 2, 2, "v", r)
    with pytest.warns(DeprecationWarning, match=r"ChunkedStage is deprecated: use PipelineStage\(modules"):
        old = ChunkedStage(copy.deepcopy(mine), g, placement="v", loss_fn=mse)
    new = PipelineStage(copy.deepcopy(mine), g, loss_fn=mse, placement="v")
    assert isinstance(old, PipelineStage) and old.v == new.v == 2 and old.placement == "v"
    xs, ts = _data(4, varlen=False)
    got = [run_schedule(st, "zbv", xs, ts, num_microbatches=4) for st in (old, new)]
    same = all(
        torch.equal(a.grad, b.grad)
        for ma, mb in zip(old.modules, new.modules, strict=True)
        for a, b in zip(ma.parameters(), mb.parameters(), strict=True)
    )
    same &= r != 0 or all(torch.equal(a, b) for a, b in zip(got[0], got[1], strict=True))
    assert all_true(same)


@pytest.mark.world(4, timeout=120)
@pytest.mark.parametrize(("name", "v"), [("zb-h1", 1), ("zbv", 2), ("interleaved-1f1b", 2)])
def test_fsdp2_chunks_equal_full_batch_backprop(name, v):
    """pp 2 x dp 2, every chunk its own FSDP2 root over dp with its layers as groups: the I/W
    split included, each group reduces once per step after its chunk's last B or W
    (:mod:`shardkit.pipeline_parallel._fsdp_steps`), and the reduced gradients are the mean over
    the dp ranks' microbatches of one process's backprop (float64, 1e-12)."""
    from torch.distributed.fsdp import fully_shard

    mesh = get_mesh((2, 2), ("pp", "dp"))
    pp, dp, m = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), 2
    placement = SCHEDULES[name].placement
    full = _model()
    xs, ts = _data(2 * m, varlen=False)
    full.zero_grad()
    (sum(mse(full(x), t) for x, t in zip(xs, ts)) / (2 * m)).backward()
    mine = copy.deepcopy(_chunks(full, 2, v, placement, pp))
    for chunk in mine:
        for layer in chunk:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(chunk, mesh=mesh["dp"])
    stage = PipelineStage(mine, mesh["pp"], loss_fn=mse, placement=placement)
    with warnings.catch_warnings():  # nn.Linear on [B, S, H] returns a view; nothing here writes into it
        warnings.filterwarnings("ignore", "FSDP2-wrapped module")
        run_schedule(stage, name, xs[dp * m : (dp + 1) * m], ts[dp * m : (dp + 1) * m], num_microbatches=m)
    ok = True
    for mod, ref in zip(mine, _chunks(full, 2, v, placement, pp), strict=True):
        for a, b in zip(mod.parameters(), ref.parameters(), strict=True):
            ok &= a.grad is not None and _close(a.grad.full_tensor(), b.grad)
    assert all_true(ok), (name, rank())


def test_last_backwards_finds_each_groups_last_b_or_w():
    """Each FSDP2 group reduces after the last B, I or W of a chunk running through it (pure)."""
    row = (Step("F", 0, 0), Step("F", 0, 1), Step("I", 0, 1), Step("B", 0, 0), Step("W", 0, 1), Step("F", 1, 0))
    assert last_backwards(row, [frozenset({0}), frozenset({1}), frozenset({0, 1}), frozenset()]) == (3, 4, 4, None)
    for name, v in (("interleaved-1f1b", 2), ("zbv", 2), ("zb-h1", 1)):
        for row in schedule_table(name, 2, v, 4):
            ends = last_backwards(row, [frozenset({c}) for c in range(v)] + [frozenset(range(v))])
            for c, i in enumerate(ends[:v]):  # a chunk's last backward step: its last microbatch's B or W
                assert row[i] == Step("W" if SCHEDULES[name].split_backward else "B", row[i].microbatch, c)
                assert not any(s.kind != "F" and s.chunk == c for s in row[i + 1 :])
            assert ends[v] == max(ends[:v]) == max(i for i, s in enumerate(row) if s.kind != "F")  # the root


def test_link_groups_are_refused_only_where_they_cannot_be_built():
    """NCCL needs its link groups; an eagerly initialized default group cannot build them from
    the pipeline's ranks alone (ncclCommSplit joins every rank): refused, naming device_id."""
    assert links_error("gloo", eager=True) is None and links_error("nccl", eager=False) is None
    assert "initialize it without device_id" in links_error("NCCL", eager=True)


def test_chunk_layers_cuts_uneven_layers_in_dataflow_order():
    assert [list(map(list, chunk_layers(10, 2, 2, "looped", r))) for r in range(2)] == [
        [[0, 1, 2], [6, 7]],
        [[3, 4, 5], [8, 9]],
    ]
    assert chunk_layers(8, 2, 2, "v", 0) == [range(0, 2), range(6, 8)]
    with pytest.raises(ShardkitError, match="need layers >= p \\* v"):
        chunk_layers(3, 2, 2, "looped", 0)


class _Scale(nn.Module):
    """``tanh(x * w)`` over the last dimension: any sequence length, any message size."""

    def __init__(self, width, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width, generator=gen, dtype=torch.float64))

    def forward(self, x):
        return torch.tanh(x * self.weight)


@pytest.mark.world(2, timeout=90)
@pytest.mark.parametrize("width", [4, 20_000])  # packed messages; over PACK_MAX_BYTES (two messages)
def test_shapes_that_change_mid_run_under_early_receives_match_backprop(width):
    """On gloo each neighbour's next receive is posted early, with the cached shape: a message of
    another shape (microbatch 2, then back; a second call with new shapes on kept caches) is
    still received whole, and losses and gradients equal one process's backprop (1e-12)."""
    r, g = rank(), world_group()
    full = nn.Sequential(*[_Scale(width, seed) for seed in range(4)])
    mine = copy.deepcopy([full[c] for c in (r, 3 - r)])  # V placement: chunks r and 3 - r
    stage = PipelineStage(mine, g, loss_fn=mse, placement="v")
    gen = torch.Generator().manual_seed(5)
    ok = True
    for lens in ([3, 3, 5, 3], [2, 4, 4, 2]):
        xs = [torch.randn(2, s, width, generator=gen, dtype=torch.float64) for s in lens]
        ts = [torch.randn(2, s, width, generator=gen, dtype=torch.float64) for s in lens]
        for mod in [*mine, *full]:
            mod.zero_grad()
        ref = [mse(full(x), t) for x, t in zip(xs, ts)]
        (sum(ref) / 4).backward()
        losses = run_schedule(stage, "dualpipev", xs, ts, num_microbatches=4)
        if r == 0:
            ok &= all(_close(a, b.detach()) for a, b in zip(losses, ref))
        ok &= all(_close(mine[i].weight.grad, full[c].weight.grad) for i, c in enumerate((r, 3 - r)))
    assert all_true(ok)


@pytest.mark.world(2, timeout=60)
def test_early_receives_receive_every_message_as_it_was_sent():
    """The ledger of a run with early receives: each rank's receives are its neighbour's sends,
    message by message in the same order and size (no message lost, split or mixed)."""
    r, p, g = rank(), world_size(), world_group()
    stage = PipelineStage(copy.deepcopy(_chunks(_model(), p, 2, "v", r)), g, loss_fn=mse, placement="v")
    xs, ts = _data(6, varlen=True)
    with CommLedger() as ledger:
        run_schedule(stage, "zbv", xs, ts, num_microbatches=6)
    mine = [
        (rec.op, rec.phase, rec.bytes_sent or rec.bytes_received)
        for rec in ledger.records
        if rec.op in ("send", "recv")
    ]
    seen = [None] * p
    torch.distributed.all_gather_object(seen, mine, group=g)
    sends = [(ph, n) for op, ph, n in seen[1 - r] if op == "send"]
    recvs = [(ph, n) for op, ph, n in mine if op == "recv"]
    assert all_true(len(recvs) > 12 and recvs == sends), (recvs, sends)


@pytest.mark.world(4, timeout=90)
def test_one_group_per_link_runs_every_direction():
    """The NCCL layout of groups (one per link, :func:`link_groups`) run on gloo: 4 links at
    p = 4, messages to both neighbours, parity with backprop."""
    r, p, g = rank(), world_size(), world_group()
    full = _model()
    mine = copy.deepcopy(_chunks(full, p, 2, "v", r))
    stage = PipelineStage(mine, g, loss_fn=mse, placement="v")
    stage.links = link_groups(stage.info, separate=True)
    pgs = {id(info.pg) for info in stage.links.values()}
    xs, ts = _data(8, varlen=True)
    full.zero_grad()
    ref = [mse(full(x), t) for x, t in zip(xs, ts)]
    (sum(ref) / 8).backward()
    losses = run_schedule(stage, "zbv", xs, ts, num_microbatches=8)
    ok = len(pgs) == 4 and (r != 0 or all(_close(a, b.detach()) for a, b in zip(losses, ref)))
    for mod, refmod in zip(mine, _chunks(full, p, 2, "v", r), strict=True):
        for a, b in zip(mod.parameters(), refmod.parameters(), strict=True):
            ok &= _close(a.grad, b.grad)
    assert all_true(ok)
