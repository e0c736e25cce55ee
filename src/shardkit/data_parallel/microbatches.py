"""FSDP2 over a step of several microbatches: gather once per step, reduce once per step.

A step of ``M`` microbatches (gradient accumulation, or a pipeline schedule's microbatches)
runs ``M`` forwards and ``M`` backwards through the same FSDP2 modules. Left at FSDP2's defaults,
every decoder block is all-gathered before each forward and again before each backward, and
its gradient is reduce-scattered (with HSDP, also all-reduced over ``dp_replicate``) after each
backward: ``2M`` gathers and ``M`` reductions per block and step. :func:`set_microbatch` tells
FSDP2 which microbatch comes next, with FSDP2's own controls, so that in a step of ``M > 1``:

* every block stays unsharded after its forward (``set_reshard_after_forward(False)``) and after
  every backward but the last (``set_reshard_after_backward``): it is all-gathered once, before
  the step's first forward, and resharded after the step's last backward;
* gradients accumulate unsharded and are reduced once, by the last microbatch's backward
  (``set_requires_gradient_sync``, which gates HSDP's ``dp_replicate`` all-reduce as well as the
  reduce-scatter, so ``set_requires_all_reduce`` needs no separate call);
  ``set_is_last_backward`` lets FSDP2 finish its reductions only then.

A step of one microbatch keeps FSDP2's defaults (ZeRO-3: a block is resharded after its forward
and gathered again for its backward): no later microbatch would reuse the gathered parameters.

Memory: with ``M > 1`` every block of the model (of the stage, under a pipeline) holds its
unsharded parameters, and their unsharded gradients, from the step's first forward to its last
backward: a rank's peak parameter-and-gradient memory during the step is that of the whole
unsharded model (stage) in place of one block's, for ``2M - 1`` fewer gathers and ``M - 1``
fewer reductions per block. Sharded optimizer state and the sharded parameters between steps
are unchanged.

Source: PyTorch FSDP2's ``FSDPModule`` controls (``set_requires_gradient_sync``,
``set_reshard_after_backward``, ``set_is_last_backward``, ``set_reshard_after_forward``);
torchtitan keeps pipelined stages unsharded between microbatches (``reshard_after_forward=False``
under pp) and ``torch.distributed.pipelining`` reduces a stage's gradients after its last backward.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..comm._compat import fsdp_end_of_backward
from ..errors import ShardkitError

__all__ = ["set_microbatch", "set_group_sync", "reduce_outside_autograd"]


def set_microbatch(module: nn.Module, index: int, count: int) -> None:
    """Tell FSDP2 that the next forward and backward of ``module`` are microbatch ``index`` of ``count``.

    Call it before microbatch ``index``'s backward (0-based), and before its forward where the
    forward comes first in the step: the trainer calls it before each microbatch of gradient
    accumulation, and with ``index=0`` before a pipeline schedule; the pipeline runner calls it
    before each backward. Microbatches must be back-propagated in order (every schedule of
    :mod:`shardkit.pipeline_parallel` does): the backward of ``index = count - 1`` reduces the
    gradients of all of them. See the module docstring for what it sets and its memory cost.

    Args:
        module: the model (or pipeline stage module) :func:`~.fsdp.apply_fsdp` was applied to,
            i.e. FSDP2's root; its FSDP2 submodules (the decoder blocks) follow it. A module
            without FSDP2 is left alone.
        index: this microbatch, ``0 <= index < count``.
        count: microbatches in the step (``M >= 1``).

    Raises:
        ShardkitError: ``count < 1`` or ``index`` outside ``[0, count)``.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ShardkitError(f"set_microbatch: count must be an int >= 1, got {count!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        raise ShardkitError(f"set_microbatch: index must be an int in [0, {count}), got {index!r}")
    last = index == count - 1
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        if sub is not module:  # FSDP2's root never reshards after forward; asking it to would
            sub.set_reshard_after_forward(count == 1, recurse=False)
        sub.set_reshard_after_backward(last, recurse=False)
        sub.set_requires_gradient_sync(last, recurse=False)
        sub.set_is_last_backward(last)


def set_group_sync(module: nn.Module, reduce: bool) -> None:
    """FSDP2 group ``module`` (one ``fully_shard`` call's parameters, without its FSDP2
    submodules): reduce its gradients and reshard it after the next backward that runs its hooks
    (``reduce``), or keep both gathered and unreduced. The per-group form of
    :func:`set_microbatch`'s backward controls, for runners whose groups finish at different
    steps (the chunked pipeline runner: each chunk's last backward)."""
    assert isinstance(module, FSDPModule)  # callers pass FSDP2 modules only
    module.set_reshard_after_backward(reduce, recurse=False)
    module.set_requires_gradient_sync(reduce, recurse=False)


def reduce_outside_autograd(root: nn.Module) -> None:
    """Run FSDP2's end of backward now, on every group of ``root``'s FSDP2 tree, as if an
    autograd backward through it had just ended: each group whose gradient sync is on
    (:func:`set_group_sync`) reduce-scatters (HSDP: and all-reduces) the gradient in its
    unsharded parameters' ``.grad`` and reshards; the others keep accumulating.

    Why: the zero-bubble ``W`` step (:func:`~shardkit.pipeline_parallel.split_backward.weight_grad`)
    adds weight gradients outside the autograd pass whose hooks FSDP2 reduces in, and FSDP2 has no
    public call that reduces without a backward. This is the one private FSDP2 name shardkit uses
    (``FSDPState._root_post_backward_final_callback``, the callback FSDP2 queues at the end of each
    backward); ``torch.distributed.pipelining`` calls the same one after a stage's last ``W``
    (``_PipelineStageBase.perform_reduce_grad``). ``tests/data_parallel/test_microbatch_sync.py``
    fails if torch renames or changes it; ``comm/_compat.fsdp_end_of_backward`` holds what differs
    between torch releases (2.15 asks for the backward's finalization mode first).

    Args:
        root: the module ``fully_shard`` was applied to last (FSDP2's root), after its first
            forward (FSDP2 initializes lazily there).
    """
    fsdp_end_of_backward(fully_shard.state(root))  # type: ignore[attr-defined]
