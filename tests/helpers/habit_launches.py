"""One launch per layout of a habits script, shared by a test module's cases (the habit-round pattern).

``Launches(script, layouts, reference, prefix)``: ``run(layout)`` launches once and caches rank 0's
``{habit: report}``; ``pair(layout, habit)`` is (ours, the reference layout's) with ours checked for
an error; ``close`` compares per-step losses within the tolerance.
"""
from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

from tests.helpers.launch import run_script

TOL = 2e-4


class Launches:
    def __init__(self, script: Path, layouts: dict, reference: dict, prefix: str) -> None:
        self.script, self.layouts, self.reference, self.prefix = script, layouts, reference, prefix
        self.run = lru_cache(maxsize=None)(self._launch)

    def _launch(self, layout: str) -> dict:
        nprocs, args, habits = self.layouts[layout]
        workdir = tempfile.mkdtemp(prefix=self.prefix)
        return run_script(self.script, nprocs, [*args, "--habits", ",".join(habits), "--dir", workdir], timeout=300)

    def pair(self, layout: str, habit: str) -> tuple:
        ours = self.run(layout)[habit]
        assert "error" not in ours, ours.get("trace")
        return ours, self.run(self.reference[layout])[habit]


def close(ours: list, ref: list, tol: float = TOL) -> None:
    """Per-step values within ``tol`` (and as many as the reference's, at least one)."""
    assert len(ours) == len(ref) >= 1, (ours, ref)
    diff = max(abs(a - b) for a, b in zip(ours, ref))
    assert diff <= tol, f"differ by {diff:.2e}: {ours} vs {ref}"
