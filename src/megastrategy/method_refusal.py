"""Replace a method of some submodules by one that raises a clear :class:`MegatronConfigError`:
for calls a layout cannot serve (``generate`` across pipeline stages, ``save_pretrained`` of a
shard), which would otherwise fail far from the cause or write wrong files without a word."""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_method"]


def refuse_method(module: nn.Module, method: str, message: Callable[[str], str]) -> None:
    """Every submodule whose class defines ``method`` gets an instance attribute of that name
    raising ``message(submodule_name)``."""
    for name, m in module.named_modules():
        if callable(getattr(type(m), method, None)):
            setattr(m, method, _raising(message(name or type(m).__name__)))


def _raising(text: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise MegatronConfigError(text)

    return refused
