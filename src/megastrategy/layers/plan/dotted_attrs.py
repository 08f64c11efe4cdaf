"""Head counts that live in a config object the module reads (``attn.config.n_head``: LitGPT)
rather than on the module itself.

A fix-up's ``attr`` may be dotted. Setting ``config.n_head`` on an attention module must not
change the other modules that share the same config object (LitGPT passes one ``Config`` to the
model and every block), so the module first gets its own shallow copy of that object; the other
fields stay the very same values.
"""
from __future__ import annotations

import copy
from typing import Any

__all__ = ["get_dotted", "set_dotted_on_own_copy"]


def get_dotted(owner: Any, attr: str, default: Any = None) -> Any:
    """``owner.a.b`` for ``attr="a.b"``; ``default`` where a link is missing."""
    for part in attr.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return default
    return owner


def set_dotted_on_own_copy(owner: Any, attr: str, value: Any, copied: set[int]) -> None:
    """Set ``owner.a.b = value`` after giving ``owner`` its own shallow copy of ``owner.a`` (once:
    ``copied`` holds the ids of the objects this apply made, so a second attribute of the same
    config goes to the same copy)."""
    *path, last = attr.split(".")
    for part in path:
        inner = getattr(owner, part)
        if id(inner) not in copied:
            inner = copy.copy(inner)
            copied.add(id(inner))
            setattr(owner, part, inner)
        owner = inner
    setattr(owner, last, value)
