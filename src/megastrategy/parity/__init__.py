"""``megastrategy check``: does my module train on a layout exactly as on one device?

:func:`run_check` trains the user's ``LightningModule`` for a few steps twice from the same seed:
under Lightning's own ``DDPStrategy`` on as many processes as the layout has data-parallel
replicas (one, usually), and under ``MegatronStrategy`` on the layout. It compares the per-step
losses and gradient norms and gives a verdict (:mod:`.report`).
"""
from megastrategy.parity.check import ParityRun, run_check
from megastrategy.parity.report import ParityReport, compare_runs

__all__ = ["ParityReport", "ParityRun", "compare_runs", "run_check"]
