"""Random initializers called from the hooks that run between the split and the first training step.

Under tensor (or expert) parallelism the layers the plan shards are the strategy's classes, not
``nn.Linear``/``nn.Embedding``: a user's ``for m in self.modules(): if isinstance(m, nn.Linear):
nn.init.normal_(m.weight)`` in ``on_fit_start`` skips every one of them and writes nothing, so no
parameter changes and the model silently trains as built. Only the code can tell: this reads the
source of the module's and the user's callbacks' hooks of that window (and, one class deep, the
methods and module-level functions they name, e.g. ``self.apply(self._init_weights)``) for calls of
random initializers (``nn.init.normal_``, ``kaiming_uniform_``, ``m.weight.data.normal_()``,
``reset_parameters()``, ...) in code that picks modules by their type (``isinstance``, ``type(m)``,
``m.__class__``): only such a pick can skip a sharded layer and write nothing; a draw into a tensor
named directly (a noise buffer, ``self.fc.weight``) either writes a watched parameter or none of the
model's. Constant fills are exact on any layout and not listed. Source that cannot be read (defined
in a REPL, compiled) is skipped.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Callable, Iterator, Optional

from torch import nn

__all__ = ["WINDOW_HOOKS", "RANDOM_INITIALIZERS", "random_initializers_in_hooks", "random_initializers_in"]

WINDOW_HOOKS = ("on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start")
RANDOM_INITIALIZERS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
    "kaiming_normal_", "orthogonal_", "sparse_", "random_", "bernoulli_", "exponential_", "log_normal_",
    "cauchy_", "geometric_", "reset_parameters", "_init_weights", "init_weights",
})
_LIBRARIES = ("torch", "lightning", "pytorch_lightning", "megastrategy", "transformers", "builtins")
_DEPTH = 3


def random_initializers_in_hooks(module: nn.Module) -> list[str]:
    """``"Class.hook line N: call"`` for each random initializer the window's hooks call, on ``module``
    (a LightningModule) and on its trainer's user callbacks."""
    owners: list[Any] = [module]
    trainer = getattr(module, "_trainer", None)
    owners += [c for c in (getattr(trainer, "callbacks", None) or []) if _user_code(type(c))]
    found: list[str] = []
    for owner in owners:
        for hook in WINDOW_HOOKS:
            method = getattr(type(owner), hook, None)
            if inspect.isfunction(method) and _user_code(method):
                calls, typed = _initializers_and_type_tests(method, type(owner))
                found += calls if typed else []
    return found


def random_initializers_in(func: Callable, owner: Optional[type]) -> list[str]:
    """The random initializer calls in ``func``'s source and in the user functions it names."""
    return _initializers_and_type_tests(func, owner)[0]


def _initializers_and_type_tests(func: Callable, owner: Optional[type], depth: int = _DEPTH,
                                 seen: Optional[set] = None) -> tuple[list[str], bool]:
    """The random initializer calls in ``func`` and the user functions it names, and whether any of
    that code tests a module's type."""
    seen = set() if seen is None else seen
    if func in seen or depth < 0:
        return [], False
    seen.add(func)
    parsed = _parse(func)
    if parsed is None:
        return [], False
    tree, source, first_line = parsed
    found = [f"{func.__qualname__} line {first_line + node.lineno - 1}: {ast.get_source_segment(source, node)}"
             for node in ast.walk(tree) if isinstance(node, ast.Call) and _callee_name(node.func) in RANDOM_INITIALIZERS]
    typed = any(_tests_a_type(node) for node in ast.walk(tree))
    for named in _named_user_functions(tree, func, owner):
        calls, named_typed = _initializers_and_type_tests(named, owner, depth - 1, seen)
        found, typed = found + calls, typed or named_typed
    return found, typed


def _tests_a_type(node: ast.AST) -> bool:
    """``isinstance(m, ...)``, ``type(m)`` or ``m.__class__``: a pick by type."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id in ("isinstance", "type")
    return isinstance(node, ast.Attribute) and node.attr == "__class__"


def _parse(func: Callable) -> Optional[tuple[ast.AST, str, int]]:
    try:
        lines, first_line = inspect.getsourcelines(func)
    except (OSError, TypeError):
        return None
    source = textwrap.dedent("".join(lines))
    try:
        return ast.parse(source), source, first_line
    except SyntaxError:
        return None


def _callee_name(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _named_user_functions(tree: ast.AST, func: Callable, owner: Optional[type]) -> Iterator[Callable]:
    """``self.<method>`` of the owner's class and global names of ``func``'s module that are user functions."""
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and owner:
            target = inspect.getattr_static(owner, node.attr, None)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            target = getattr(func, "__globals__", {}).get(node.id)
        if isinstance(target, (staticmethod, classmethod)):
            target = target.__func__
        if inspect.isfunction(target) and _user_code(target):
            yield target


def _user_code(obj: Any) -> bool:
    return not (getattr(obj, "__module__", None) or "builtins").split(".")[0] in _LIBRARIES
