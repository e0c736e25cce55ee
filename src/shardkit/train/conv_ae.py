"""``shardkit train --model conv-ae --spatial R``: a convolutional autoencoder on real photos,
each frame sharded along its width over ``R`` ranks with :func:`~shardkit.spatial.apply_spatial`
(``--spatial-h``: along its height; both: H x W tiles on the 2-D mesh ``(spatial_h, spatial)``).

The image is matplotlib's sample photo ``grace_hopper.jpg`` (ships with matplotlib, nothing is
downloaded). Every step draws ``B`` random crops ``[B, 3, H, W]`` from a seeded generator, the
same crops on every rank and in the ``--verify`` reference. Rank ``r`` keeps columns
``[offset_r, offset_r + W_r)`` (balanced split; rows likewise over ``spatial_h``); the model's
halo exchanges and norm statistics make its local output exactly the matching block of the
unsharded output.

Loss: mean squared reconstruction error over the whole global batch. Each rank back-propagates
the sum of its local squared errors divided by the global element count (the trainer's
convention, :mod:`.trainer`); the converted layers sum parameter gradients over the spatial
group and the trainer's gradient reduction over the data-parallel ranks, so every rank ends with
the unsharded model's gradient and AdamW keeps the replicated parameters identical.

bfloat16: the sharded GroupNorm computes its statistics, normalization and affine in float32
and rounds once, as torch's ``group_norm`` (the reference) does; in bfloat16 arithmetic it
drifted by many roundings per call and ``--verify`` failed its 2e-2 tolerance. What remains
(about 1e-2 in the GroupNorm biases after 20 steps) is the spread of any two single-process
bfloat16 runs that differ only in summation order (channels-last vs channels-first, or the
batch in two halves).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .. import balanced_split_sizes
from .._files import atomic_write
from .._shapes import split_offsets
from ..comm._group import resolve_group
from ..comm.agree import agree
from ..comm.checks import checks_enabled
from ..comm.host_sync import to_device
from ..spatial._meta import layout_key

__all__ = [
    "CROP",
    "IMAGE",
    "SPATIAL_DIMS",
    "ConvAutoencoder",
    "build_conv_ae",
    "load_image",
    "CropSampler",
    "block_shard",
    "sharded_dims",
    "ConvAETask",
    "eval_batch",
    "side_by_side",
    "save_reconstruction",
]

IMAGE = "grace_hopper.jpg"
CROP = (48, 80)  # (H, W); W = 80 splits into >= 8 columns per rank for up to 10 ranks, H into 6
MIN_LOCAL_WIDTH = 8  # the dilated conv's halo (2 columns at half resolution) must fit in a neighbour
SPATIAL_DIMS = (("spatial_h", 2), ("spatial", 3))  # mesh dim -> the NCHW dim it shards
EVAL_SEED = 20  # the crops of reconstruction.png: a fixed batch, the same in every run whatever --seed
EVAL_SAMPLES = 4


class _Residual(nn.Module):
    """``x + block(x)``: dilation-2 conv, GroupNorm, SiLU (no parameters of its own)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=2, dilation=2), nn.GroupNorm(8, channels), nn.SiLU()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class ConvAutoencoder(nn.Sequential):
    """``[B, 3, H, W] -> [B, 3, H, W]`` (``H``, ``W`` even): stride-2 encoder, a dilated residual
    block at half resolution, nearest x2 upsampling and a conv decoder."""

    def __init__(self) -> None:
        super().__init__(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.SiLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.GroupNorm(8, 32),
            nn.SiLU(),
            _Residual(32),
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.Conv2d(32, 16, 3, padding=1),
            nn.SiLU(),
            nn.Conv2d(16, 3, 3, padding=1),
        )


def build_conv_ae(dtype: str, seed: int) -> ConvAutoencoder:
    """The unsharded model in ``dtype``, training mode; initialized in float32 from ``seed``, then
    cast (bitwise the same weights on every rank and in the reference)."""
    torch.manual_seed(seed)
    return ConvAutoencoder().to(getattr(torch, dtype)).train()


def load_image(name: str = IMAGE) -> torch.Tensor:
    """matplotlib's sample photo ``name`` as ``[3, H, W]`` float32 in [0, 1]."""
    import matplotlib.cbook
    import matplotlib.image

    pixels = matplotlib.image.imread(matplotlib.cbook.get_sample_data(name, asfileobj=False))
    x = torch.from_numpy(pixels.copy()).permute(2, 0, 1)[:3]
    return x.float() / 255 if x.dtype == torch.uint8 else x.float()


class CropSampler:
    """Random crops of one image, the same sequence of global batches on every rank.

    Args:
        image: ``[C, H_img, W_img]``.
        crop: ``(H, W)`` of a crop, at most the image's size.
        batch_size: crops per global batch ``B``.
        seed: seed of the ``torch.Generator`` that draws the crop corners.
    """

    def __init__(self, image: torch.Tensor, crop: tuple[int, int], batch_size: int, seed: int) -> None:
        if crop[0] > image.shape[1] or crop[1] > image.shape[2]:
            raise ValueError(f"CropSampler: crop {crop} larger than the image {tuple(image.shape[1:])}")
        self.image, self.crop, self.batch_size = image, crop, batch_size
        self.gen = torch.Generator().manual_seed(seed)

    def next_batch(self) -> torch.Tensor:
        """The next global batch: ``[B, C, H, W]``."""
        (h, w), (_, hi, wi) = self.crop, self.image.shape
        tops = torch.randint(0, hi - h + 1, (self.batch_size,), generator=self.gen).tolist()
        lefts = torch.randint(0, wi - w + 1, (self.batch_size,), generator=self.gen).tolist()
        return torch.stack([self.image[:, top : top + h, left : left + w] for top, left in zip(tops, lefts)])


_BLOCKS: dict = {}  # (group, dim, full size, local size) -> every rank's local size


def block_shard(x_full: torch.Tensor, local_size: int, group, dim: int) -> torch.Tensor:
    """This rank's block of ``x_full`` along ``dim``, given its size there (every rank's is gathered).

    The sizes are all-gathered (one tiny collective), so the split of a layer's output (which
    the spatial layers choose) need not be the balanced split of the input. In the default mode
    once per full shape and local size (the layers split a full shape the same way every time, so
    every rank finds its entry or none does); every call with the check mode on.
    """
    key = (group, dim, tuple(x_full.shape), local_size)
    sizes = _BLOCKS.get(key) if not checks_enabled() else None
    if sizes is None:
        sizes = agree(resolve_group(group, "block_shard"), "block_shard", None, local_size, gather=True)
        if len(_BLOCKS) >= 64:
            _BLOCKS.clear()
        _BLOCKS[key] = sizes
    if sum(sizes) != x_full.shape[dim]:
        raise RuntimeError(f"block_shard: local sizes {sizes} do not add up to {x_full.shape[dim]} along dim {dim}")
    return x_full.narrow(dim, split_offsets(sizes)[dist.get_rank(group)], local_size)


def sharded_dims(mesh) -> list[tuple[str, int]]:
    """``(mesh dim, NCHW dim)`` of the spatial dims ``mesh`` shards (H before W; none without a mesh)."""
    return [(name, dim) for name, dim in SPATIAL_DIMS if mesh is not None and mesh.size(name) > 1]


class ConvAETask:
    """The trainer's task for the autoencoder: random crops, sharded along W over ``spatial`` and
    along H over ``spatial_h``.

    The loss is the sum of squared errors of this rank's pixels (the batch rows of its
    data-parallel coordinate, its spatial block or tile); the trainer divides by the global
    element count.

    Args:
        sampler: :class:`CropSampler`.
        device: where the crops go.
        dtype: the crops' dtype.
    """

    def __init__(self, sampler: CropSampler, device, dtype: torch.dtype) -> None:
        self.sampler, self.device, self.dtype = sampler, device, dtype

    def next_batch(self) -> torch.Tensor:
        return self.sampler.next_batch()

    @staticmethod
    def count(batch: torch.Tensor) -> int:
        return batch.numel()

    @staticmethod
    def microbatches(batch: torch.Tensor, dp_rank: int, dp: int, m: int) -> list[torch.Tensor]:
        rows = batch.shape[0] // dp
        return list(batch[dp_rank * rows : (dp_rank + 1) * rows].split(rows // m))

    def prepare(self, mb: torch.Tensor, pm) -> tuple[dict, torch.Tensor]:
        x_full = to_device(mb, self.device).to(self.dtype)  # pinned, non-blocking off the CPU
        x = x_full
        for name, dim in sharded_dims(pm.mesh):
            sizes = balanced_split_sizes(x_full.shape[dim], pm.mesh.size(name))
            r = pm.mesh.local_rank(name)
            x = x.narrow(dim, split_offsets(sizes)[r], sizes[r])
        return {"x": x, "full_shape": tuple(x_full.shape)}, x_full

    @staticmethod
    def forward(module, inputs: dict) -> torch.Tensor:
        # the crop's global shape fixes every layer's split: each learns its sizes once per shape
        with layout_key(inputs["full_shape"]):
            return module(inputs["x"])

    @staticmethod
    def loss_sum(out: torch.Tensor, x_full: torch.Tensor, pm) -> torch.Tensor:
        """Sum of squared errors over this rank's output block; half precision upcast."""
        target = x_full
        for name, dim in sharded_dims(pm.mesh):
            target = block_shard(target, out.shape[dim], pm.mesh[name].get_group(), dim)
        if out.dtype in (torch.float16, torch.bfloat16):
            out, target = out.float(), target.float()
        return (out - target).pow(2).sum()


def eval_batch(samples: int = EVAL_SAMPLES) -> torch.Tensor:
    """The fixed evaluation crops ``[samples, 3, H, W]`` (float32, seeded by ``EVAL_SEED``)."""
    return CropSampler(load_image(), CROP, samples, EVAL_SEED).next_batch()


def side_by_side(inputs: torch.Tensor, outputs: torch.Tensor, scale: int = 2, gap: int = 2) -> np.ndarray:
    """One RGB picture: the inputs on the top row, their reconstructions below.

    Args:
        inputs: ``[B, 3, H, W]`` in [0, 1].
        outputs: ``[B, 3, H, W]``, clamped to [0, 1].
        scale: each pixel repeated ``scale`` x ``scale`` times (the crops are small).
        gap: white pixels between tiles.

    Returns:
        ``uint8`` array ``[2 * H * scale + gap, B * W * scale + (B - 1) * gap, 3]``.
    """
    b, _, h, w = inputs.shape
    hs, ws = h * scale, w * scale
    grid = np.full((2 * hs + gap, b * ws + (b - 1) * gap, 3), 255, dtype=np.uint8)
    for row, images in enumerate((inputs, outputs)):
        pixels = images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8)
        tiles = pixels.repeat_interleave(scale, -2).repeat_interleave(scale, -1).permute(0, 2, 3, 1).cpu().numpy()
        for i, tile in enumerate(tiles):
            top, left = row * (hs + gap), i * (ws + gap)
            grid[top : top + hs, left : left + ws] = tile
    return grid


def save_reconstruction(
    model: nn.Module,
    path: str | os.PathLike,
    batch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``path`` (PNG): the crops of ``batch`` and ``model``'s reconstructions, side by side.

    Args:
        model: an unsharded :class:`ConvAutoencoder` (e.g. loaded with the trained full parameters).
        path: the PNG file, replaced atomically.
        batch: ``[B, 3, H, W]``; default :func:`eval_batch`.

    Returns:
        ``(inputs, outputs)``: the batch and what ``model`` returned for it (model dtype).
    """
    import matplotlib.image

    inputs = eval_batch() if batch is None else batch
    param = next(model.parameters())
    with torch.no_grad():
        outputs = model(inputs.to(param.device, param.dtype))
    grid = side_by_side(inputs, outputs)
    atomic_write(Path(path), lambda tmp: matplotlib.image.imsave(tmp, grid, format="png"))
    return inputs, outputs
