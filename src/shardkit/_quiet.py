"""Third-party chatter: no progress bars of other libraries, their warnings once per job.

Every rank of a job loads the same checkpoint and writes the same kind of log, so N ranks print
N copies of the same Hugging Face warnings, interleaved: rank 0's copy says everything, the other
ranks stay quiet. Progress bars of transformers and huggingface_hub (loading weights, de-quantizing
a GGUF file, writing an export) are off in every process, rank 0's too (issue 32): shardkit says
each set-up stage itself, and a tqdm bar in a log file is a line of carriage returns.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings

__all__ = ["QUIET_ENV", "BAR_ENV", "quiet_third_party", "no_progress_bars"]

QUIET_ENV: dict[str, str] = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # read by huggingface_hub and transformers at import
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TQDM_DISABLE": "1",  # bars drawn with tqdm itself (transformers' GGUF load), if tqdm is not imported yet
}
"""Environment that silences Hugging Face progress bars and advisory logs in a process."""

BAR_ENV: dict[str, str] = {k: QUIET_ENV[k] for k in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")}
"""The part of :data:`QUIET_ENV` that turns the bars off (the logs stay)."""


def no_progress_bars() -> None:
    """Turn off the progress bars of huggingface_hub, transformers and tqdm in this process.

    Call it before transformers is imported (it reads the environment at import) and again after:
    then it also switches off the bars of an already imported transformers, and of a tqdm that
    torch imported before (tqdm reads ``TQDM_DISABLE`` only at import).
    """
    os.environ.update(BAR_ENV)
    if "tqdm" in sys.modules:
        # torch imports tqdm (torch.hub) before this runs: turn its bars off by default instead.
        # transformers' GGUF load draws one with tqdm directly (not through its own, switchable, bars).
        import tqdm.std  # type: ignore[import-untyped]

        if not getattr(tqdm.std.tqdm.__init__, "_shardkit_quiet", False):
            quiet_init = functools.partialmethod(tqdm.std.tqdm.__init__, disable=True)
            quiet_init._shardkit_quiet = True  # type: ignore[attr-defined]
            tqdm.std.tqdm.__init__ = quiet_init
    if "transformers" in sys.modules:
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:  # a stand-in module under that name (a test blocking the hf extra)
            return
        hf_logging.disable_progress_bar()


def quiet_third_party(rank: int) -> None:
    """No third-party progress bar (:func:`no_progress_bars`), and third-party warnings on rank 0 only.

    Call it first thing in each rank's process, before transformers is imported (it reads the
    environment at import), and again after: then it also switches off the bars and logs of an
    already imported transformers.

    Args:
        rank: this process's global rank; rank 0 keeps the warnings.
    """
    no_progress_bars()
    if rank == 0:
        return
    os.environ.update(QUIET_ENV)
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="huggingface_hub")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
