"""parallelize_conv without the CLI: spatial x dp on a tiny conv model matches one process.

Float64 parity of the output block and of every reduced parameter gradient (the sharded W not
divisible by the spatial ranks), the H x W tiled case, one process unchanged, and the layouts a
convolutional model cannot take refused on every rank. Both gradient reductions: ``"sum"`` with
every block's loss over the global element count, ``"mean"`` (the default) over its dp rank's.
"""

import pytest
import torch
from torch import nn

from shardkit import ParallelDims, ShardkitError, balanced_split_sizes
from shardkit._shapes import split_offsets
from shardkit.parallelize import parallelize_conv
from shardkit.spatial import SpatialConv2d

NCHW = (("spatial_h", 2), ("spatial", 3))
TOL = dict(rtol=1e-9, atol=1e-12)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 3, 3, padding=2, dilation=2)
    ).double()


def _block(x: torch.Tensor, mesh, dims=NCHW) -> torch.Tensor:
    """This rank's block of ``x``: its dp rows, then its balanced split along each sharded dim."""
    dp, r = mesh.size("dp_cp"), mesh.local_rank("dp_cp")
    x = x.narrow(0, r * x.shape[0] // dp, x.shape[0] // dp)
    for name, dim in dims:
        sizes = balanced_split_sizes(x.shape[dim], mesh.size(name))
        x = x.narrow(dim, split_offsets(sizes)[mesh.local_rank(name)], sizes[mesh.local_rank(name)])
    return x


def _parity(dims: ParallelDims, width: int, grad_reduce: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 3, 6, width, dtype=torch.float64)
    ref = _model()
    ref_out = ref(x)
    (ref_out.pow(2).sum() / ref_out.numel()).backward()

    mesh = dims.build_mesh("cpu")
    pm = parallelize_conv(_model(), mesh, NCHW, grad_reduce=grad_reduce)
    assert pm.cp is None and not pm.sequence_parallel and not pm.loss_parallel
    assert isinstance(pm.module[0], SpatialConv2d)
    out = pm.module(_block(x, mesh))
    torch.testing.assert_close(out, _block(ref_out.detach(), mesh), **TOL)
    # this rank's share of the global mean ("sum") or of its dp rank's mean ("mean")
    elements = ref_out.numel() // (mesh.size("dp_cp") if grad_reduce == "mean" else 1)
    (out.pow(2).sum() / elements).backward()
    pm.grads.reduce()
    for (name, p), (_, q) in zip(pm.module.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


@pytest.mark.world(4, timeout=60)
@pytest.mark.parametrize("grad_reduce", ["mean", "sum"])
def test_spatial_2_x_dp_2_matches_one_process(grad_reduce):
    _parity(ParallelDims(spatial=2, dp_replicate=2), width=7, grad_reduce=grad_reduce)  # 7 columns: 4 + 3


@pytest.mark.world(4, timeout=60)
@pytest.mark.parametrize("grad_reduce", ["mean", "sum"])
def test_h_x_w_tiles_match_one_process(grad_reduce):
    _parity(ParallelDims(spatial_h=2, spatial=2), width=5, grad_reduce=grad_reduce)


@pytest.mark.world(4, timeout=60)
@pytest.mark.parametrize("grad_reduce", ["mean", "sum"])
def test_dp_shard_holds_whole_replicas(grad_reduce):
    _parity(ParallelDims(spatial=2, dp_shard=2), width=6, grad_reduce=grad_reduce)


def test_one_process_is_unchanged():
    model = _model()
    pm = parallelize_conv(model, None, NCHW)
    assert pm.module is model and pm.mesh is None and isinstance(model[0], nn.Conv2d)


@pytest.mark.world(4, timeout=60)
@pytest.mark.parametrize(
    "dims,spatial_dims,match",
    [
        (ParallelDims(tp=2, spatial=2), NCHW, "parallelize_conv: tp=2 on a convolutional model"),
        (ParallelDims(cp_ring=2, dp_replicate=2), NCHW, "parallelize_conv: cp=2 on a convolutional model"),
        (ParallelDims(spatial=4), (("tp", 3),), r"spatial_dims names \['tp'\]"),
    ],
)
def test_layouts_a_conv_model_cannot_take_are_refused(dims, spatial_dims, match):
    mesh = dims.build_mesh("cpu")
    with pytest.raises(ShardkitError, match=match):
        parallelize_conv(_model(), mesh, spatial_dims)
