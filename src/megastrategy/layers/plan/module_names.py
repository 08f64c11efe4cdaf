"""Dotted-name arithmetic the plan passes need beyond :mod:`megastrategy.naming`: ancestors,
common ancestors, globs that stand for every repeat of a block, and close-name suggestions."""
from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["common_ancestor", "ancestors", "globify", "close_names", "is_inside"]


def common_ancestor(names: list[str]) -> str:
    """Deepest module that is an ancestor of (or equal to the parent of) every name."""
    split = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def ancestors(name: str) -> Iterable[str]:
    """Strict ancestors, nearest first (the root ``""`` excluded)."""
    while "." in name:
        name = name.rsplit(".", 1)[0]
        yield name


def is_inside(name: str, ancestor: str) -> bool:
    """Is ``name`` strictly beneath the (non-root) module ``ancestor``?"""
    return name.startswith(ancestor + ".")


def globify(name: str) -> str:
    """``blocks.3.attn.q`` -> ``blocks.*.attn.q``: one glob for every repeat of a block."""
    return ".".join("*" if p.isdigit() else p for p in name.split("."))


def close_names(query: str, names: list[str], n: int = 5) -> list[str]:
    candidates = list(dict.fromkeys(names + [globify(x) for x in names]))
    close = difflib.get_close_matches(query, candidates, n=n, cutoff=0.6)
    if not close:
        tail = query.rsplit(".", 1)[-1]
        close = [c for c in candidates if c.rsplit(".", 1)[-1] == tail][:n]
    if not close:
        close = difflib.get_close_matches(query, candidates, n=n, cutoff=0.3)
    return close
