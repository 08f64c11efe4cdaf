"""Refuse sharding a layer that carries the user's hooks: module hooks, pruning, gradient hooks.

A sharded layer is a new module built from the user's layer's tensors, so what the user attached to
the layer or to its parameters is not carried over: a forward or backward hook that records a
statistic, torch's ``prune`` pre-hook that multiplies ``weight_orig`` by ``weight_mask``, a
``p.register_hook`` that scales a gradient. At tp2 a norm logged by a forward hook on a column-sharded
Linear stayed at the value of the set-up check's run (26.8, one device's 71.4), pruned weights trained
again (10.444 against 10.401 at the second step), an embedding's scaled gradient was a plain one:
silently. Nor could the hooks be moved onto the shard: they would see a shard's values. So such a layer
is refused by name before the split, naming what keeps it exact. Hooks of libraries (transformers,
peft, torch's own, this package's) are theirs to keep and are not counted; ``prune`` is.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

from torch import nn
from torch.nn.utils import prune

from megastrategy.errors import MegatronConfigError

__all__ = ["refuse_user_hooks", "user_hooks"]

#: where hooks that are not the user's come from (a library keeps its own)
_LIBRARIES = ("torch.", "transformers.", "peft.", "accelerate.", "lightning.", "megastrategy.")
_MODULE_HOOKS = {"_forward_pre_hooks": "a forward pre-hook", "_forward_hooks": "a forward hook",
                 "_backward_pre_hooks": "a backward pre-hook", "_backward_hooks": "a backward hook"}
_TENSOR_HOOKS = {"_backward_hooks": "a gradient hook (register_hook)",
                 "_post_accumulate_grad_hooks": "a post-accumulate-grad hook"}


def _origin(hook: Any) -> str:
    """The module that defined ``hook`` (a function, a bound method, a partial or a callable object)."""
    fn = getattr(hook, "func", hook)
    return getattr(fn, "__module__", None) or type(fn).__module__ or ""


def _is_users(hook: Any) -> bool:
    if isinstance(hook, prune.BasePruningMethod):
        return True
    return not (_origin(hook) + ".").startswith(_LIBRARIES)


def _described(hook: Any, kind: str) -> str:
    if isinstance(hook, prune.BasePruningMethod):
        return f"torch.nn.utils.prune's {type(hook).__name__} on {getattr(hook, '_tensor_name', 'weight')!r}"
    return f"{kind} {getattr(hook, '__qualname__', type(hook).__name__)!r}"


def user_hooks(module: nn.Module, prefix: str) -> Iterator[tuple[str, str, bool]]:
    """``(where, what, on a parameter)`` for each of the user's hooks on ``module``, its sub-modules and their parameters."""
    for name, m in module.named_modules(prefix=prefix):
        for attr, kind in _MODULE_HOOKS.items():
            for hook in getattr(m, attr, {}).values():
                if _is_users(hook):
                    yield name, _described(hook, kind), False
        for pname, p in m.named_parameters(prefix=name, recurse=False):
            for attr, kind in _TENSOR_HOOKS.items():
                for hook in (getattr(p, attr, None) or {}).values():
                    if _is_users(hook):
                        yield pname, _described(hook, kind), True


def _first_hooked(module: nn.Module, entries) -> Optional[tuple[Any, str, str, bool]]:
    for entry in entries:
        if entry.style == "replicate":
            continue
        for found in user_hooks(module.get_submodule(entry.name), entry.name):
            return (entry, *found)
    return None


def refuse_user_hooks(module: nn.Module, plan, tp: int) -> None:
    """Raise if a layer the resolved ``plan`` shards (or a layer or parameter inside it) has a user's hook."""
    hit = _first_hooked(module, plan.entries)
    if hit is None:
        return
    entry, where, what, on_parameter = hit
    removal = ("torch.nn.utils.prune.remove(module, 'weight') to make the pruning permanent"
               if "prune" in what else "the handle's remove()")
    elsewhere = "" if on_parameter else "hook a module the plan keeps whole (the block around it), "
    raise MegatronConfigError(
        f"tp={tp}: {where!r} has {what}, and the plan shards {entry.name!r} ({entry.style}, from {entry.source}): "
        "a sharded layer is a new module built from its tensors, so the hook would not run (and would see a "
        "shard's values if it did): what it records or changes would differ silently from one device's. Keep the "
        f"layer whole with tp_plan={{{entry.name!r}: 'replicate'}} (and replicate the layers that read its output "
        f"or feed its input sharded), {elsewhere}remove it before fit with {removal}, or use tp=1."
    )
