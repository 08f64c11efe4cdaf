"""Run a function on a module the moment it finishes loading, without importing it ourselves.

``import megastrategy`` must stay light (``import megastrategy.pipeline`` needs no Lightning, which
takes seconds to import), yet some of Lightning's modules need a word from megastrategy once they
exist: the strategy registry (named presets) and the checkpoint loader of
``LightningModule.load_from_checkpoint``. :func:`when_loaded` calls ``callback(module)`` at once
when the module is already loaded, otherwise right after its code has run, through a finder that
answers for that one name, once, and then leaves ``sys.meta_path``.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable

__all__ = ["when_loaded"]


class _ThenCall(importlib.abc.Loader):
    """Runs the real loader, then the callback on the module it loaded."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[Any], None]) -> None:
        self.loader, self.callback = loader, callback

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self.loader, name)


class _WaitFor(importlib.abc.MetaPathFinder):
    """Answers for ``fullname`` only, once; every other import passes by."""

    def __init__(self, fullname: str, callback: Callable[[Any], None]) -> None:
        self.fullname, self.callback = fullname, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)  # fires once; the real finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self.callback)
        return spec


def when_loaded(fullname: str, callback: Callable[[Any], None], ready: Callable[[Any], bool]) -> None:
    """``callback(module)`` now if ``fullname`` is loaded and ``ready(module)`` (not half-initialised),
    else as soon as it loads. Idempotent: a second call for a name already waited for adds nothing."""
    loaded = sys.modules.get(fullname)
    if loaded is not None and ready(loaded):
        callback(loaded)
    elif not any(isinstance(f, _WaitFor) and f.fullname == fullname for f in sys.meta_path):
        sys.meta_path.insert(0, _WaitFor(fullname, callback))
