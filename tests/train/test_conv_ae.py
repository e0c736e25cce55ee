"""``shardkit train --model conv-ae``: crop sampler, model builder, loss and options in-process;
the report's picture from a spatial run in a 2-rank world; one spatial=2 end-to-end ``--verify``
run (slow tier) and one up-front failure as subprocesses."""

import os
import subprocess
import sys
import time

import pytest
import torch

from harness.helpers import rank, remove_shared_dir, shared_tmpdir, world_size
from harness.limits import patient
from shardkit import ShardkitError
from shardkit.train.config import TrainConfig, merge_config, validate_config
from shardkit.train.conv_ae import (
    CROP,
    ConvAETask,
    CropSampler,
    build_conv_ae,
    eval_batch,
    load_image,
    save_reconstruction,
    side_by_side,
)


def test_image_is_a_real_photo_in_unit_range():
    image = load_image()
    assert image.dtype == torch.float32 and image.shape[0] == 3 and min(image.shape[1:]) >= max(CROP)
    assert 0 <= image.min() and image.max() <= 1 and image.std() > 0.05


def test_crop_sampler_is_deterministic_with_the_right_shapes():
    image = load_image()
    a, b = CropSampler(image, (48, 80), 4, seed=3), CropSampler(image, (48, 80), 4, seed=3)
    first = a.next_batch()
    assert first.shape == (4, 3, 48, 80) and first.dtype == torch.float32
    assert torch.equal(first, b.next_batch()) and torch.equal(a.next_batch(), b.next_batch())
    assert not torch.equal(first, a.next_batch())  # a new draw each step
    assert not torch.equal(first, CropSampler(image, (48, 80), 4, seed=4).next_batch())
    # Each crop is a window of the image.
    tiny = torch.arange(2 * 5 * 6, dtype=torch.float32).view(2, 5, 6)
    crop = CropSampler(tiny, (2, 3), 1, seed=0).next_batch()[0]
    top, left = divmod(int(crop[0, 0, 0]), 6)
    assert torch.equal(crop, tiny[:, top : top + 2, left : left + 3])
    with pytest.raises(ValueError, match="larger than the image"):
        CropSampler(tiny, (6, 3), 1, seed=0)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_model_builder_is_seeded_and_keeps_the_frame_size(dtype):
    model, again = build_conv_ae(dtype, seed=0), build_conv_ae(dtype, seed=0)
    assert model.training and all(p.dtype == getattr(torch, dtype) for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert not torch.equal(next(model.parameters()), next(build_conv_ae(dtype, seed=1).parameters()))
    x = torch.rand(2, 3, *CROP, dtype=getattr(torch, dtype))
    assert model(x).shape == x.shape
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"Conv2d", "GroupNorm", "Upsample", "SiLU"} <= kinds
    convs = [m for m in model.modules() if type(m).__name__ == "Conv2d"]
    assert any(c.stride == (2, 2) for c in convs) and any(c.dilation == (2, 2) for c in convs)


def test_task_loss_is_the_sum_of_squared_errors():
    # The trainer divides by the global numel: the sum over W-halves (or tiles) is the mean squared error.
    out, target = torch.randn(2, 3, 4, 6, dtype=torch.float64), torch.randn(2, 3, 4, 6, dtype=torch.float64)

    class OneProcess:
        mesh = None

    mean = ConvAETask.loss_sum(out, target, OneProcess) / out.numel()
    torch.testing.assert_close(mean, torch.nn.functional.mse_loss(out, target))
    halves = sum(ConvAETask.loss_sum(o, t, OneProcess) for o, t in zip(out.split(3, -1), target.split(3, -1)))
    torch.testing.assert_close(halves / out.numel(), torch.nn.functional.mse_loss(out, target))
    assert ConvAETask.loss_sum(out.bfloat16(), target.bfloat16(), OneProcess).dtype == torch.float32
    assert ConvAETask.count(out) == out.numel()


def test_reconstruction_png_is_the_model_output_side_by_side(tmp_path):
    import matplotlib.image

    model = build_conv_ae("float32", seed=0)
    inputs, outputs = save_reconstruction(model, tmp_path / "reconstruction.png")
    assert torch.equal(inputs, eval_batch()) and inputs.shape == (4, 3, *CROP)  # a fixed batch
    with torch.no_grad():
        assert torch.equal(outputs, model(inputs))
    png = matplotlib.image.imread(tmp_path / "reconstruction.png")
    h, w = CROP
    assert png.shape[:2] == (2 * 2 * h + 2, 4 * 2 * w + 3 * 2)  # 2 rows, 4 tiles, 2x pixels, 2-pixel gaps
    pixels = torch.from_numpy((png[..., :3] * 255).round()).to(torch.uint8)
    expect = outputs[1].clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0)
    top, left = 2 * h + 2, 2 * w + 2  # second row, second tile, every other pixel
    assert torch.equal(pixels[top : top + 2 * h : 2, left : left + 2 * w : 2], expect)
    assert torch.equal(pixels[: 2 * h : 2, : 2 * w : 2], inputs[0].mul(255).round().to(torch.uint8).permute(1, 2, 0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reconstruction.png"]  # no temporary file left


def test_side_by_side_layout():
    a = torch.zeros(2, 3, 2, 3)
    b = torch.full((2, 3, 2, 3), 2.0)  # clamped to 1
    grid = side_by_side(a, b, scale=1, gap=1)
    assert grid.shape == (5, 7, 3) and grid.dtype.name == "uint8"
    assert (grid[:2, :3] == 0).all() and (grid[3:, 4:] == 255).all() and (grid[2] == 255).all()


def test_conv_ae_layout():
    cfg = validate_config(merge_config({}, dict(model="conv-ae", spatial=2)))
    assert (cfg.nproc, cfg.spatial, cfg.dp_replicate, cfg.tp, cfg.pp) == (2, 2, 1, 1, 1)
    assert validate_config(merge_config({}, {})).nproc == 4  # llama's default is unchanged
    assert validate_config(merge_config({}, dict(model="conv-ae", spatial=4)), world_size=4).nproc == 4
    # spatial composes with data parallelism (replicas and FSDP2)
    both = validate_config(merge_config({}, dict(model="conv-ae", spatial=2, dp=2)))
    assert (both.nproc, both.dp_replicate) == (4, 2)
    assert validate_config(merge_config({}, dict(model="conv-ae", spatial=2, nproc=4))).dp_replicate == 2
    # H x W tiles: spatial_h x spatial ranks per frame
    tiles = validate_config(merge_config({}, dict(model="conv-ae", spatial_h=2, spatial=3, dp=2)))
    assert (tiles.nproc, tiles.spatial_h, tiles.spatial) == (12, 2, 3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(spatial=2), "--spatial 2 needs --model conv-ae"),
        (dict(model="conv-ae", tp=2), "--tp 2 with --model conv-ae"),
        (dict(model="conv-ae", pp=2, dp=2), "--pp 2 with --model conv-ae"),
        (dict(model="conv-ae", cp_ring=2), "--cp-ring 2 with --model conv-ae"),
        (dict(model="conv-ae", spatial=2, dp=1, nproc=4), "dp_replicate=1 = 2 ranks, but --nproc is 4"),
        (dict(model="conv-ae", spatial=3, nproc=4), "must divide --nproc 4"),
        (dict(model="conv-ae", spatial=11), "--spatial 11: .* fewer than 8 columns"),
        (dict(model="conv-ae", spatial=0), "--spatial must be >= 1"),
        (dict(model="conv-ae", spatial_h=7), "--spatial-h 7: .* fewer than 8 rows"),
        (dict(model="conv-ae", spatial_h=0), "--spatial-h must be >= 1"),
        (dict(spatial_h=2), "--spatial-h 2 needs --model conv-ae"),
        (dict(model="resnet"), "--model must be one of llama, qwen2, qwen3, moe, mla, gemma2, conv-ae"),
    ],
)
def test_invalid_conv_ae_options(kwargs, match):
    with pytest.raises(ShardkitError, match=match):
        validate_config(merge_config({}, kwargs))


def _shardkit(*argv, timeout):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *argv], capture_output=True, text=True, timeout=patient(timeout), env=env
    )


@pytest.mark.world(2, timeout=120)
def test_a_spatial_run_with_a_report_writes_the_trained_models_reconstruction():
    """The trainer's report hook for conv-ae (``spec.outputs``, run.py) in a spatial=2 world: the
    tiles' parameters gathered whole on rank 0, ``reconstruction.png`` written beside the metrics
    and listed in the result; its spatial collectives are in the ledger. The quick tier's stand-in
    for the end-to-end CLI run below (the CLI's own report path is tests/cli/test_train_cli.py's)."""
    import matplotlib.image

    from shardkit.train.run import train

    folder = shared_tmpdir("shardkit-conv-report-")
    try:
        cfg = validate_config(
            TrainConfig(model="conv-ae", spatial=2, steps=1, dtype="float32", report=folder), world_size=world_size()
        )
        result = train(cfg, "gloo", torch.device("cpu"), time.perf_counter(), progress=False)
        if rank() == 0:
            png = os.path.join(folder, "reconstruction.png")
            assert png in result["files"], result["files"]
            h, w = CROP
            assert matplotlib.image.imread(png).shape[:2] == (4 * h + 2, 8 * w + 6)
            assert any(row["api"] == "spatial_conv2d" for row in result["ledger"]), result["ledger"]
    finally:
        remove_shared_dir(folder)


@pytest.mark.slow  # the CLI around the in-world run above; 12 s on 2 cores (2 spawned ranks)
def test_end_to_end_spatial_verify(tmp_path):
    # the timeout only bounds a hang
    proc = _shardkit(
        "train",
        "--model",
        "conv-ae",
        "--spatial",
        "2",
        "--nproc",
        "2",
        "--steps",
        "2",
        "--verify",
        "--report",
        str(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "spatial=2" in proc.stdout and "PASSED" in proc.stdout and "spatial_conv2d" in proc.stdout
    import matplotlib.image

    h, w = CROP
    assert matplotlib.image.imread(tmp_path / "reconstruction.png").shape[:2] == (4 * h + 2, 8 * w + 6)
    assert {"metrics.jsonl", "report.json", "loss.png", "reconstruction.png", "tb"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert "reconstruction.png" in proc.stdout


def test_spatial_with_llama_fails_before_launch():
    proc = _shardkit("train", "--spatial", "2", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "--spatial 2 needs --model conv-ae" in proc.stderr and not proc.stdout
