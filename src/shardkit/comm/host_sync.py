"""Count the operations that make an accelerator's host wait (host syncs), by source line.

A CUDA host queues kernels and runs ahead of the device; it stops and waits when it needs a
value the device computes, or when a copy from the host must finish before it may go on.
:class:`HostSyncCounter` is a ``TorchDispatchMode`` that sees every aten op and counts two kinds:

``reads`` (device-to-host: the host waits for the device's queue to drain)
    * ``aten._local_scalar_dense``: ``item()``, ``int(t)``, ``float(t)``, ``bool(t)``, an ``if t``;
    * ``aten.equal`` and ``aten.is_nonzero`` (a Python bool of device data);
    * ops whose output shape depends on the data: ``nonzero`` (``torch.where(c)``),
      ``masked_select``, the ``unique`` family, ``bincount``, ``repeat_interleave`` of a tensor
      without ``output_size``, ``index`` / ``index_put_`` with a boolean mask (``x[mask]``);
    * copies ``aten._to_copy`` / ``aten.copy_`` from a non-CPU tensor to the CPU (``.cpu()``);
    * on a CPU counter, ``Tensor.tolist()``, ``Tensor.numpy()`` and ``Tensor.cpu()`` (they bypass
      the dispatcher on the CPU; on an accelerator they are a ``_to_copy`` to the CPU, counted above).

``h2d`` (blocking host-to-device copies: the host waits for the copy)
    * ``aten._to_copy`` / ``aten.copy_`` from the CPU to another device, unless the copy is
      ``non_blocking`` from pinned memory;
    * ``aten.lift_fresh`` of a tensor on the counter's device: ``torch.tensor(python_data,
      device=d)`` / ``torch.as_tensor`` (on an accelerator a copy from pageable memory);
    * on a CPU counter, ``Tensor.to(...)`` called from shardkit naming a CPU device without
      ``non_blocking`` (a no-op on the CPU, a blocking copy to the device on an accelerator when
      the tensor is host data). Not from transformers: it moves its own buffers with
      ``.to(x.device)``, a no-op where they already are (on an accelerator any real copy is an
      aten copy, counted above).

On an accelerator these are exactly the blocking points (every one stalls the host once). On a
CPU-only run host and device share memory, so the counter treats the CPU as "the device": every
read of a tensor and every tensor built from Python data is counted as it would be on an
accelerator. Code that works on data the trainer keeps on the host by construction (the sampler's
batches before they are copied to the device, their document boundaries) says so with
:func:`host_side`; nothing inside it is counted (on an accelerator those tensors are CPU tensors
and cost no sync either). For the same reason a CPU counter skips reads made inside torch's own
host-resident structures: ``DeviceMesh`` (its ``mesh`` tensor is always on the CPU) and
``torch.optim`` (its ``step`` counters stay on the CPU unless ``capturable`` or ``fused``).

Each count is recorded under the first frame of the call stack inside shardkit or transformers
(``file:line function``), so a report says where every sync comes from. The method follows
torch's own ``torch.cuda.set_sync_debug_mode`` (which warns on CUDA at the same points), made
countable and usable on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from types import FrameType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "host_side", "to_device"]

_aten = torch.ops.aten
_READ_OPS = {
    _aten._local_scalar_dense.default,
    _aten.equal.default,
    _aten.is_nonzero.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
    _aten.bincount.default,
}
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
_COPY_OPS = {_aten._to_copy.default, _aten.copy_.default}
_LIFT_OPS = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}

_state = threading.local()


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Mark code that only touches host-resident data (not counted by :class:`HostSyncCounter`).

    For the trainer's own host data (the sampled batch before it is copied to the device, its
    document boundaries, the target count). Nesting is allowed; costs one attribute write.
    """
    depth = getattr(_state, "host", 0)
    _state.host = depth + 1
    try:
        yield
    finally:
        _state.host = depth


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` (host data) on ``device`` without a blocking copy: pinned and copied ``non_blocking``
    on an accelerator (the copy is ordered on the current stream; the caching host allocator keeps
    the pinned buffer until it is done), ``t`` itself on the CPU (no copy exists to make)."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _host_side() -> bool:
    return getattr(_state, "host", 0) > 0


# torch's structures that live on the CPU whatever the device (skipped by a CPU counter)
_HOST_RESIDENT = ("/torch/optim/", "/torch/distributed/device_mesh.py")


def _where(cpu: bool) -> str | None:
    """``file:line function`` of the innermost frame in shardkit (not this file) or transformers;
    None (not counted) for a CPU counter when a frame below it is in :data:`_HOST_RESIDENT`."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if cpu and any(part in name for part in _HOST_RESIDENT):
            return None
        for root in ("/shardkit/", "/transformers/"):
            cut = name.rfind(root)
            if cut >= 0 and not name.endswith("comm/host_sync.py"):
                return f"{name[cut + 1 :]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "<outside shardkit>"


class HostSyncCounter(TorchDispatchMode):
    """Count host syncs (see the module docstring) while active; per step with :meth:`next_step`.

    Args:
        device: the device the model runs on (``"cpu"`` for a CPU-only run: see the module
            docstring for what that counts).

    Use::

        counter = HostSyncCounter(device)
        with counter:
            for _ in range(steps):
                train_step(...)
                counter.next_step()
        counter.steps  # [{"reads": Counter({"file:line fn": n}), "h2d": Counter(...)}, ...]

    Not thread-safe across threads that share one counter (the trainer's step runs on one thread).
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.steps: list[dict[str, Counter]] = []
        self._current: dict[str, Counter] = {"reads": Counter(), "h2d": Counter()}
        self._patched: list[tuple[str, object]] = []

    # -- per step ---------------------------------------------------------------------------
    def next_step(self) -> dict[str, Counter]:
        """Close the current step: append its counts to :attr:`steps` and return them."""
        done, self._current = self._current, {"reads": Counter(), "h2d": Counter()}
        self.steps.append(done)
        return done

    @staticmethod
    def totals(step: dict[str, Counter]) -> tuple[int, int]:
        """``(reads, h2d)`` of one step's counts."""
        return sum(step["reads"].values()), sum(step["h2d"].values())

    def _count(self, kind: str, what: str, shardkit_only: bool = False) -> None:
        if _host_side():
            return
        where = _where(self.device.type == "cpu")
        if where is not None and not (shardkit_only and not where.startswith("shardkit/")):
            self._current[kind][f"{where} [{what}]"] += 1

    # -- the Python-level reads the dispatcher does not see on the CPU ---------------------------
    def __enter__(self):
        if self.device.type == "cpu":
            for name in ("tolist", "numpy", "cpu", "to"):
                original = getattr(torch.Tensor, name)
                self._patched.append((name, original))
                setattr(torch.Tensor, name, self._wrap(name, original))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in reversed(self._patched):
            setattr(torch.Tensor, name, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def _wrap(self, name: str, original):
        def read(t: torch.Tensor, *args, **kwargs):
            if name != "to":
                self._count("reads", name)
            else:
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
                if device is not None and device.type == "cpu" and not non_blocking:
                    self._count("h2d", "to(device)", shardkit_only=True)
            return original(t, *args, **kwargs)

        return read

    # -- every aten op ------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READ_OPS:
            self._count("reads", func.__name__.split(".")[0])
        elif func in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self._count("reads", f"{func.__name__.split('.')[0]} by mask")
        elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._count("reads", "repeat_interleave")
        elif func in _COPY_OPS:
            self._copy(func, args, kwargs)
        elif func in _LIFT_OPS and args[0].device == self._device_of(args[0]):
            self._count("h2d", "tensor from host data")
        return func(*args, **kwargs)

    def _device_of(self, t: torch.Tensor) -> torch.device:
        """The counter's device, with the index of ``t`` when the counter names none."""
        if self.device.index is None and t.device.type == self.device.type:
            return t.device
        return self.device

    def _copy(self, func, args, kwargs) -> None:
        if func is _aten.copy_.default:
            dst, src = args[0].device, args[1].device
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            pinned = args[1].device.type == "cpu" and non_blocking and args[1].is_pinned()
        else:
            src = args[0].device
            dst = torch.device(kwargs.get("device") or src)
            non_blocking = kwargs.get("non_blocking", False)
            pinned = src.type == "cpu" and non_blocking and args[0].is_pinned()
        if src.type != "cpu" and dst.type == "cpu":
            self._count("reads", "copy to host")
        elif src.type == "cpu" and dst.type != "cpu" and not pinned:
            self._count("h2d", "blocking copy to device")
