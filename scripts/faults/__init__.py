"""The fault trials of ``scripts/fault_trials.py``, one module per family: :mod:`.launcher`,
:mod:`.save`, :mod:`.writers`; :mod:`.worker` is the job they kill, :mod:`.common` what both sides share."""
