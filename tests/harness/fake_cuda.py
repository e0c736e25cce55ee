"""Fake CUDA tensors on this CPU build: which kernels a code path would launch, and how large.

torch's ``FakeTensorMode`` makes tensors on a ``cuda`` device without a GPU and runs every aten
op's meta kernel, the fused attention kernels included, so the ops a path dispatches and the
shapes it allocates are those a real GPU would see. Two limits of a CPU build, and how this
module meets them:

* A few handwritten Python bindings (``Tensor.__getitem__`` / ``__setitem__``, ``copy_``,
  ``contiguous``, ``__invert__``) open a CUDA device guard before they dispatch, which a CPU
  build cannot construct. :class:`GuardFree` sends those calls to the same aten ops through the
  dispatcher, where the fake mode serves them; the code under test is unchanged.
* The autograd engine needs CUDA's device guard and streams for a fake CUDA tensor that requires
  grad (the process aborts). In a process of its own, ``fake_cuda_shim.cpp`` provides them
  (``fake_cuda_step.py``: whole training steps); inside pytest, :func:`forward_backward` runs an
  autograd Function's ``forward`` and ``backward`` directly instead, with a stand-in context.

A fake tensor has no values: a host read of one raises :class:`HostRead`, or is answered with the
value a :class:`ReadRecorder` saw at the same place in a real run of the same code.

One process plays rank 0 of a world on torch's ``fake`` process group (every collective returns
at once, nothing moves): :func:`fake_world`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardkit.comm.host_sync import _host_side, _where

aten = torch.ops.aten


def _index(t: torch.Tensor, index) -> torch.Tensor:
    """``t[index]`` for ints, slices, ``None`` and one ``...``, as aten view ops."""
    index = index if isinstance(index, tuple) else (index,)
    if all(isinstance(i, torch.Tensor) for i in index):  # advanced indexing of the leading dims
        return aten.index.Tensor(t, list(index))
    if any(isinstance(i, torch.Tensor | list) for i in index):
        raise NotImplementedError(f"GuardFree indexing: {index!r}")
    at = [n for n, i in enumerate(index) if i is Ellipsis]
    if at:  # ``...`` stands for every dim the other entries leave out
        fill = t.dim() - sum(i is not None and i is not Ellipsis for i in index)
        index = index[: at[0]] + (slice(None),) * fill + index[at[0] + 1 :]
    dim = 0
    for i in index:
        if i is None:
            t = aten.unsqueeze.default(t, dim)
            dim += 1
        elif isinstance(i, int):
            t = aten.select.int(t, dim, i)
        else:
            t = aten.slice.Tensor(t, dim, i.start, i.stop, 1 if i.step is None else i.step)
            dim += 1
    return t


def _to_target(t: torch.Tensor, args: tuple, kwargs: dict) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of ``t.to(*args, **kwargs)``."""
    device, dtype = kwargs.get("device", t.device), kwargs.get("dtype", t.dtype)
    for a in args:
        if isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, str | torch.device | int):
            device = torch.device("cuda", a) if isinstance(a, int) else torch.device(a)
    return torch.device(device), dtype


class HostRead(RuntimeError):
    """A value of a CUDA tensor was read on the host (a device synchronization on a GPU)."""


# by name: a fake tensor overrides ``tolist`` with its own method; ``torch.equal`` returns a bool
_HOST_READS = {"__int__", "__float__", "__bool__", "__index__", "item", "tolist", "equal"}


class GuardFree(TorchFunctionMode):
    """Routes the guard-opening bindings to the dispatcher (module docstring).

    A host read of a CUDA tensor raises :class:`HostRead`, or, given ``answers`` (what a
    :class:`ReadRecorder` saw in a CPU run of the same code), returns the next recorded value after
    checking that it was recorded at the same op and shape; ``log.reads`` lists the reads answered.
    """

    def __init__(self, log: OpLog, answers: list | None = None) -> None:
        super().__init__()
        self.log, self.answers = log, answers

    def _answer(self, func, t: torch.Tensor):
        what = (func.__name__, list(t.shape))
        if self.answers is None:
            raise HostRead(f"{what[0]} of a {t.device.type} fake tensor {what[1]}: a host read")
        if not self.answers:
            raise HostRead(f"{what}: a host read the CPU run did not make")
        name, shape, value = self.answers.pop(0)
        if (name, shape) != what:
            raise HostRead(f"{what}: a host read where the CPU run read {(name, shape)}")
        self.log.reads.append(what)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.pin_memory:  # page-locking is a host property (no fake kernel): as it is
            return args[0]
        if _host_side() and not any(isinstance(t, FakeTensor) for t in pytree.tree_leaves((args, kwargs))):
            with unset_fake_temporarily():  # the trainer's host data (shardkit's host_side()): real CPU work
                return func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(args[0], torch.Tensor):
            t = args[0]
            if func is torch.Tensor.cuda:
                device, dtype = torch.device("cuda"), t.dtype
            else:
                device, dtype = _to_target(t, args[1:], kwargs)
            if "cuda" in (device.type, t.device.type) and (device.type != t.device.type or dtype != t.dtype):
                non_blocking = bool(kwargs.get("non_blocking", False))
                return aten._to_copy.default(t, dtype=dtype, device=device, non_blocking=non_blocking)
            if "cuda" in (device.type, t.device.type):
                return t
        if getattr(func, "__name__", None) in _HOST_READS and args and isinstance(args[0], FakeTensor):
            if _where(cpu=True) is not None:  # not torch's CPU-resident structures: as ReadRecorder
                return self._answer(func, args[0])  # of the device, or of a host copy of it (``.cpu()``)
        if not (args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cuda"):
            return func(*args, **kwargs)
        if func is torch.Tensor.__getitem__:
            return _index(*args)
        if func is torch.Tensor.__setitem__:
            view, value = _index(args[0], args[1]), args[2]
            if isinstance(value, torch.Tensor):
                aten.copy_.default(view, value)
            else:
                aten.fill_.Scalar(view, value)
            return None
        if func is torch.Tensor.copy_:
            return aten.copy_.default(args[0], args[1])
        if func is torch.Tensor.contiguous:
            x = args[0]
            return x if x.is_contiguous() else aten.clone.default(x, memory_format=torch.contiguous_format)
        if func is torch.Tensor.__invert__:
            return aten.bitwise_not.default(args[0])
        return func(*args, **kwargs)


class OpLog(TorchDispatchMode):
    """Every aten op dispatched, the largest tensor any op returned, and where data went.

    Attributes:
        ops: op names in dispatch order.
        largest: ``(elements, "op -> shape")`` of the largest tensor returned.
        collectives: ``(op, device type)`` of every tensor handed to a c10d op.
        to_host: ops that returned a CPU tensor from CUDA inputs (a device-to-host copy or a
            CPU fallback).
        to_device: ``(op, shape, non_blocking)`` of every CPU tensor copied to the device.
        reads: ``(op, shape)`` of every host read of a CUDA tensor that :class:`GuardFree` answered.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.largest = (0, "")
        self.collectives: list[tuple[str, str]] = []
        self.to_host: list[str] = []
        self.to_device: list[tuple[str, list[int], bool]] = []
        self.reads: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.ops.append(name)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func.namespace in ("c10d", "_c10d_functional"):
            self.collectives += [(name, t.device.type) for t in inputs]
        on_device = any(t.device.type == "cuda" for t in inputs)
        if on_device and any(t.device.type == "cpu" for t in outputs):
            self.to_host.append(name)
        if name in ("_to_copy", "copy_") and inputs and inputs[-1].device.type == "cpu":
            if any(t.device.type == "cuda" for t in outputs):
                non_blocking = (kwargs or {}).get("non_blocking", len(args) > 2 and bool(args[2]))
                self.to_device.append((name, list(inputs[-1].shape), non_blocking))
        for t in outputs:
            if t.numel() > self.largest[0]:
                self.largest = (t.numel(), f"{name} -> {list(t.shape)}")
        return out


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[dist.ProcessGroup]:
    """Rank 0 of a ``world_size`` world on torch's fake process group, torn down afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    assert not dist.is_initialized(), "a process group is already initialized in this process"
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


class ReadRecorder(TorchFunctionMode):
    """Records every host read of a tensor with its value, as ``HostSyncCounter`` on a CPU run
    counts them (not inside shardkit's ``host_side()``, nor under torch's structures that stay on
    the CPU whatever the device): ``reads`` is ``[(op, shape, value)]``, what :class:`GuardFree`
    answers a fake run with."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, list[int], object]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        host = _host_side() or _where(cpu=True) is None  # host data, or torch's CPU-resident structures
        if getattr(func, "__name__", None) in _HOST_READS and isinstance(args[0], torch.Tensor) and not host:
            self.reads.append((func.__name__, list(args[0].shape), out))
        return out


@contextlib.contextmanager
def fake_cuda(answers: list | None = None, log: OpLog | None = None) -> Iterator[OpLog]:
    """Fake CUDA tensors with the guard-free bindings; yields the op log (``log``, or a new one)
    of everything inside. ``answers``: the host reads' values (:class:`GuardFree`), in order."""
    log = OpLog() if log is None else log
    # a fake tensor's own ``tolist`` reads element by element; send it to GuardFree as one read
    with (
        mock.patch.object(FakeTensor, "tolist", torch.Tensor.tolist),
        FakeTensorMode(allow_non_fake_inputs=True),
        GuardFree(log, answers),
        log,
    ):
        yield log


class _Ctx:
    """Stand-in for an autograd Function's context: what ``forward`` saves, ``backward`` reads."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def forward_backward(monkeypatch, function: type[torch.autograd.Function], grads: list) -> None:
    """Make ``function.apply`` run ``forward`` then ``backward`` (with a ones gradient) directly,
    appending each backward's result to ``grads``."""

    def apply(*args):
        ctx = _Ctx()
        out = function.forward(ctx, *args)
        grads.append(function.backward(ctx, torch.ones_like(out)))
        return out

    monkeypatch.setattr(function, "apply", apply)


def to_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """Move ``module``'s parameters and buffers to fake CUDA tensors in place (inside
    :func:`fake_cuda`); ``Module.to`` cannot, as it assigns a fake tensor to a real one's ``.data``."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = torch.nn.Parameter(p.to("cuda"), requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = b.to("cuda")
    return module
