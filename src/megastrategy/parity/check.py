"""Run both sides of a parity check and compare them (see the package docstring)."""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from megastrategy.config import MegatronConfig
from megastrategy.parity.launch import launch_ranks
from megastrategy.parity.report import ParityReport, compare_runs

__all__ = ["ParityRun", "run_check"]


@dataclass(frozen=True)
class ParityRun:
    """What to train: the user's module (and datamodule) by import path, and for how long.

    ``dropout_off`` zeroes every dropout (modules and Hugging Face's float rates), since dropout
    masks under tensor parallelism are drawn per shard and cannot equal one device's.
    """

    module: str
    module_args: dict[str, Any] = field(default_factory=dict)
    datamodule: Optional[str] = None
    datamodule_args: dict[str, Any] = field(default_factory=dict)
    steps: int = 5
    seed: int = 1234
    dropout_off: bool = True
    tolerance: float = 2e-4
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"megastrategy check: steps={self.steps!r} must be a positive integer, e.g. 5.")
        if ":" not in self.module and "." not in self.module:
            raise ValueError(f"megastrategy check: module={self.module!r} must be an import path, "
                             "e.g. 'my_project.models:MyModule'.")


def run_check(run: ParityRun, layout: dict[str, Any], devices: int) -> ParityReport:
    """Train ``run`` under ``MegatronStrategy(**layout)`` on ``devices`` processes and under
    ``DDPStrategy`` on the layout's data-parallel size (the same global batch), and compare."""
    dp = MegatronConfig(**layout).layout(devices).dp  # a bad layout fails here, before any process starts
    with tempfile.TemporaryDirectory(prefix="megastrategy-check-") as tmp:
        reference = _train(run, None, dp, Path(tmp) / "reference")
        ours = _train(run, layout, devices, Path(tmp) / "layout")
    name = " ".join(f"{k}={v}" for k, v in layout.items()) or "tp=1 pp=1"
    return compare_runs(reference, ours, layout=f"MegatronStrategy({name}) on {devices} process(es)",
                        reference_name=f"DDPStrategy on {dp} process(es)", tolerance=run.tolerance)


def _train(run: ParityRun, layout: Optional[dict[str, Any]], devices: int, stem: Path) -> dict[str, Any]:
    spec, out = stem.with_suffix(".spec.json"), stem.with_suffix(".out.json")
    spec.write_text(json.dumps(dict(asdict(run), layout=layout, devices=devices)))
    launch_ranks(["-m", "megastrategy.parity.worker", str(spec), str(out)], devices, timeout=run.timeout)
    return json.loads(out.read_text())
