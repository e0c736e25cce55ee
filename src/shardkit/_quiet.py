"""Third-party chatter once per job: progress bars and library warnings on rank 0 only.

Every rank of a job loads the same checkpoint and writes the same kind of log, so N ranks print
N copies of the same Hugging Face progress bar and the same warnings, interleaved. Rank 0's copy
says everything; the other ranks stay quiet.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["QUIET_ENV", "quiet_third_party"]

QUIET_ENV: dict[str, str] = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # read by huggingface_hub and transformers at import
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TQDM_DISABLE": "1",  # bars drawn with tqdm itself (transformers' GGUF load), if tqdm is not imported yet
}
"""Environment that silences Hugging Face progress bars and advisory logs in a process."""


def quiet_third_party(rank: int) -> None:
    """Silence third-party progress bars and warnings on every rank but 0.

    Call it first thing in each rank's process, before transformers is imported (it reads the
    environment at import), and again after: then it also switches off the bars and logs of an
    already imported transformers.

    Args:
        rank: this process's global rank; rank 0 keeps its output.
    """
    if rank == 0:
        return
    os.environ.update(QUIET_ENV)
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="huggingface_hub")
    import sys

    if "tqdm" in sys.modules:
        # torch imports tqdm (torch.hub) before this runs, and tqdm reads TQDM_DISABLE only at
        # import: turn its bars off in this process by default instead. transformers' GGUF load
        # draws one with tqdm directly (not through its own, switchable, progress bars).
        import functools

        import tqdm.std  # type: ignore[import-untyped]

        tqdm.std.tqdm.__init__ = functools.partialmethod(tqdm.std.tqdm.__init__, disable=True)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
