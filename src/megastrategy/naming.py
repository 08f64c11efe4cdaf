"""Dotted module names as ``named_modules()`` spells them (``""`` is the root module).

Plans, built-in detection and the Transformer Engine conversion all build and take apart such
names; they share these helpers so that the root and empty parts are handled one way.
"""
from __future__ import annotations

__all__ = ["join_name", "parent_name"]


def join_name(*parts: str) -> str:
    """``join_name("a", "", "b") == "a.b"``: empty parts (the root) are skipped."""
    return ".".join(p for p in parts if p)


def parent_name(name: str) -> str:
    """Name of the module holding ``name`` (``""`` for a direct child of the root)."""
    return name.rsplit(".", 1)[0] if "." in name else ""
