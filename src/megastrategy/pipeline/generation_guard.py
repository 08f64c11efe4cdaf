"""Refuse Hugging Face ``generate()`` on a pipelined model, with the reason and what works.

Generation runs the model once per new token, feeding each token back and keeping a key/value
cache per layer; pipeline stages run one model call per microbatch and relay only its output.
Without a guard the first decoding step reaches a module the stage does not hold and fails with
a message about module placement that never mentions ``generate``."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_generation"]


def refuse_generation(module: nn.Module, pp: int) -> None:
    """Make ``generate`` of every Hugging Face model inside ``module`` raise a clear error."""
    for name, m in module.named_modules():
        if callable(getattr(type(m), "generate", None)) and hasattr(m, "config"):
            m.generate = _refusal(name or type(m).__name__, pp)


def _refusal(name: str, pp: int) -> Callable[..., Any]:
    def generate(*args: Any, **kwargs: Any) -> Any:
        raise MegatronConfigError(
            f"{name}.generate() with pp={pp}: generation runs the model once per new token with a key/value cache, "
            "and pipeline stages run one model call per microbatch. Generate with pp=1 (tensor and data parallelism "
            "generate exactly), e.g. trainer.validate/predict with MegatronStrategy(tp=...) on the checkpoint, or "
            "compute teacher-forced metrics from the logits the step's model call returns."
        )

    return generate
