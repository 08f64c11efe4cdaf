"""The verdict of a parity check: per-step loss and gradient-norm differences against one device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ParityReport", "compare_runs"]


@dataclass(frozen=True)
class ParityReport:
    """Per-step values of the reference run and of the layout, and whether they agree within ``tolerance``."""

    layout: str
    reference: str
    tolerance: float
    ref_losses: list[float]
    losses: list[float]
    ref_grad_norms: list[float]
    grad_norms: list[float]
    warnings: tuple[str, ...] = ()  # what megastrategy warned about during the layout's run

    @property
    def loss_diffs(self) -> list[float]:
        return [abs(a - b) for a, b in zip(self.losses, self.ref_losses)]

    @property
    def grad_norm_diffs(self) -> list[float]:
        return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.grad_norms, self.ref_grad_norms)]

    @property
    def complete(self) -> bool:
        n = len(self.ref_losses)
        return n > 0 and len(self.losses) == n and len(self.grad_norms) == len(self.ref_grad_norms)

    @property
    def passed(self) -> bool:
        diffs = self.loss_diffs + self.grad_norm_diffs
        return self.complete and all(d <= self.tolerance for d in diffs)

    def format(self) -> str:
        """The table and the verdict, as ``megastrategy check`` prints them."""
        lines = [f"megastrategy check: {self.layout} against {self.reference}",
                 f"{'step':>4}  {'loss (reference)':>16}  {'loss (layout)':>14}  {'|diff|':>9}  "
                 f"{'grad norm (ref)':>15}  {'grad norm':>10}  {'rel diff':>9}"]
        for i, (ra, a) in enumerate(zip(self.ref_losses, self.losses)):
            g = (self.ref_grad_norms[i], self.grad_norms[i]) if i < min(len(self.grad_norms), len(self.ref_grad_norms)) else (float("nan"),) * 2
            rel = abs(g[1] - g[0]) / max(abs(g[0]), 1e-12)
            lines.append(f"{i:>4}  {ra:>16.6f}  {a:>14.6f}  {abs(a - ra):>9.2e}  {g[0]:>15.6f}  {g[1]:>10.6f}  {rel:>9.2e}")
        if not self.complete:
            lines.append(f"steps recorded: reference {len(self.ref_losses)}, layout {len(self.losses)}")
        worst = max(self.loss_diffs + self.grad_norm_diffs, default=float("nan"))
        verdict = "PASS" if self.passed else "FAIL"
        lines += [f"the layout's run warned: {w}" for w in self.warnings]
        lines.append(f"{verdict}: largest difference {worst:.2e} (tolerance {self.tolerance:.0e}; losses absolute, "
                     "gradient norms relative)")
        return "\n".join(lines)


def compare_runs(reference: dict[str, Any], run: dict[str, Any], *, layout: str, reference_name: str,
                 tolerance: float) -> ParityReport:
    """Build the report from the two runs' recorded ``losses`` and ``grad_norms``."""
    return ParityReport(layout=layout, reference=reference_name, tolerance=tolerance,
                        ref_losses=list(reference["losses"]), losses=list(run["losses"]),
                        ref_grad_norms=list(reference["grad_norms"]), grad_norms=list(run["grad_norms"]),
                        warnings=tuple(run.get("warnings", ())))
