"""One GEMM for all local experts: ``torch._grouped_mm`` where the build runs it, a padded ``bmm`` otherwise.

Rows arrive grouped by expert (``counts[e]`` rows for expert ``e``, contiguous, in expert order:
what :func:`shardkit.expert_parallel.token_dispatch` and the sort of
:func:`shardkit._experts.routed_experts_forward` produce). :class:`ExpertGroups` describes that
grouping once per layer call and picks one of two paths for all its projections:

* ``"grouped_mm"``: one ``torch._grouped_mm(x [N, K], w [E, K, M], offs)`` per projection (the
  kernel Megatron-LM's ``GroupedMLP`` and torchtitan use). Used where this torch build has it,
  runs it for the device and dtype (float64 never; measured once per device and dtype by a tiny
  forward and backward, since the supported set differs by build and GPU), every row stride
  is a multiple of 16 bytes (the kernel's constraint: ``K`` and ``M`` times the element size)
  and, under ``torch.compile``, the dtype is bfloat16 (:func:`grouped_mm_fits`).
* ``"bmm"``: the rows are scattered into a zero-padded ``[E, C, K]`` buffer (``C`` = the largest
  count), one ``torch.bmm`` runs all experts, and the rows are gathered back. Exact in float64
  (each output row is the same dot products as a per-expert ``mm``); costs ``E * C`` rows of
  memory and compute, up to ``E`` times the rows when one expert gets them all.

Both are plain autograd ops, so backward is exact and an expert without rows gets a zero
gradient (never ``None``): data-parallel reducers see the same parameters on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ExpertGroups", "grouped_mm_fits", "grouped_mm_supported"]

_ALIGN = 16  # bytes: torch._grouped_mm's stride constraint


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    ``_grouped_mm``'s backward rejects an expanded gradient (strides ``[0, 0]``, e.g. from
    ``y.sum()``); this sits on its output so its backward always gets a dense one.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward for ``dtype`` on ``device_type`` here.

    Measured once (a 2-expert product with an empty expert) and remembered: CPU builds run
    float32, bfloat16 and float16; CUDA builds depend on the GPU. Never float64 (the kernel
    rejects it).
    """
    key = (device_type, dtype)
    if key not in _PROBED:
        _PROBED[key] = _probe(device_type, dtype)
    return _PROBED[key]


# Run eagerly even when first asked inside torch.compile: not part of any graph. torch's own
# lazy form of torch.compiler.disable: it imports Dynamo at the first call, not at shardkit's
# import: `shardkit train`'s launcher imports the planner for its checks and never compiles
# (0.6 core-s of its 3.4 measured).
@torch._disable_dynamo
def _probe(device_type: str, dtype: torch.dtype) -> bool:
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    # Its own small graph, outside any caller's: the first call may come inside a checkpointed
    # forward, whose saved-tensor hooks would count the probe's tensors there but not in the
    # recompute (torch.utils.checkpoint's CheckpointError); identity hooks take them instead.
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            x = torch.ones(4, 8, dtype=dtype, device=device_type, requires_grad=True)
            w = torch.ones(2, 8, 8, dtype=dtype, device=device_type, requires_grad=True)
            offs = torch.tensor([0, 4], dtype=torch.int32, device=device_type)
            y = grouped(x, w, offs=offs)
            torch.autograd.grad(y, (x, w), torch.ones_like(y))
    except (RuntimeError, NotImplementedError, TypeError):
        return False  # not built for this device / dtype / GPU: the bmm path runs instead
    return True


def grouped_mm_fits(device_type: str, dtype: torch.dtype, dims: Sequence[int]) -> bool:
    """Whether the grouped kernel takes this call: it runs here (:func:`grouped_mm_supported`),
    every ``K`` / ``M`` in ``dims`` is a 16-byte multiple, and, under ``torch.compile``, the
    dtype is bfloat16 (the kernel's meta function, which tracing runs, takes nothing else, even
    where the eager CPU kernel runs float32: measured on torch 2.13)."""
    size = torch.empty((), dtype=dtype).element_size()
    if any(d * size % _ALIGN for d in dims):
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False
    return grouped_mm_supported(device_type, dtype)


class ExpertGroups:
    """Rows grouped by expert, and the one GEMM path every projection of this call takes.

    Args:
        counts: ``[E]`` host ints, rows per expert (zeros allowed), summing to ``N``.
        device: of the rows and weights.
        dtype: of the weights (the GEMM's dtype).
        dims: every inner and outer dim ``K`` / ``M`` the projections will use (the alignment
            check of the grouped kernel).
        device_counts: the same counts as a tensor on ``device`` when the caller has them (no
            host-to-device copy then).
        path: force ``"grouped_mm"`` or ``"bmm"`` (tests, the bench); None chooses.
    """

    def __init__(
        self,
        counts: Sequence[int],
        device: torch.device,
        dtype: torch.dtype,
        dims: Sequence[int],
        *,
        device_counts: torch.Tensor | None = None,
        path: str | None = None,
    ) -> None:
        self.counts = [int(c) for c in counts]
        self.rows = sum(self.counts)
        # the caller's device copy as it is (a .to(device) would count as a host-to-device copy)
        dev_counts = (
            device_counts.long()
            if device_counts is not None
            else torch.tensor(self.counts, dtype=torch.long, device=device)
        )
        if path is None:
            path = "grouped_mm" if grouped_mm_fits(torch.device(device).type, dtype, dims) else "bmm"
        self.path = path
        self.device_counts = dev_counts
        if path == "grouped_mm":
            self.offs = dev_counts.cumsum(0).to(torch.int32)
        else:
            # Row i of expert e (its p-th row) goes to slot e * C + p of the padded buffer.
            self.capacity = max(self.counts, default=0)
            experts = torch.arange(len(self.counts), device=device)
            row_expert = torch.repeat_interleave(experts, dev_counts, output_size=self.rows)
            starts = dev_counts.cumsum(0) - dev_counts
            pos = torch.arange(self.rows, device=device) - starts.index_select(0, row_expert)
            self.slot = row_expert * self.capacity + pos

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``[N, K] x [E, K, M] -> [N, M]``: row block ``e`` of ``x`` times ``w[e]`` (any strides of ``w``)."""
        if self.path == "grouped_mm":
            grouped = getattr(torch, "_grouped_mm")
            return _ContiguousGrad.apply(grouped(x.contiguous(), w, offs=self.offs))
        n_exp, k, m = w.shape
        padded = x.new_zeros(n_exp * self.capacity, k).index_copy(0, self.slot, x)
        out = torch.bmm(padded.view(n_exp, self.capacity, k), w)
        return out.view(n_exp * self.capacity, m).index_select(0, self.slot)

    def add_bias(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``y [N, M] + bias[e]`` on expert ``e``'s rows (``bias [E, M]``)."""
        return y + torch.repeat_interleave(bias, self.device_counts, dim=0, output_size=self.rows)
