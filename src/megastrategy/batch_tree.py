"""Batches as Lightning accepts them, flattened into tensors and rebuilt with their own types.

``torch.utils._pytree`` treats a ``Mapping`` it does not know (Hugging Face's ``BatchEncoding``,
which ``DataCollatorWithPadding`` and the MLM collators return, or a ``UserDict``) as one opaque
leaf, so its tensors could be neither split into microbatches nor broadcast as tensors. Here
such mappings are walked like dicts and rebuilt as their own type afterwards, without
registering anything in torch's global pytree registry. Dataclass batches (Lightning's
``apply_to_collection`` moves them to the device, so users return them from ``collate_fn``) are
walked field by field the same way and rebuilt by calling their class with the fields, when every
field is an ``__init__`` argument; otherwise they stay one leaf. The description of the structure is
plain data, so it can travel to other ranks with the batch.

Given the batch size, a list of strings exactly that long is one text per example (what
``default_collate`` makes of a string field: the texts beside their token ids) and becomes one
:class:`PerExample` leaf, so that it can be split and joined with the tensors. Lists of numbers
and tuples stay as they were: ``(batch, length)`` or a list of per-layer sizes is no example list.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Optional

from torch.utils._pytree import SUPPORTED_NODES, TreeSpec, tree_flatten, tree_unflatten

__all__ = ["BatchSpec", "PerExample", "flatten_batch", "unflatten_batch"]

_TEXTS = (str, bytes)


@dataclass(frozen=True)
class PerExample:
    """One value per example, kept as one leaf: sliced like a tensor's dim 0, joined by concatenation."""

    values: tuple

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index: slice) -> "PerExample":
        return PerExample(self.values[index])


def _per_example(obj: Any, size: Optional[int]) -> bool:
    return (size is not None and size > 1 and type(obj) is list and len(obj) == size
            and all(isinstance(v, _TEXTS) for v in obj))


@dataclass(frozen=True)
class BatchSpec:
    """Where the batch's leaves go (``tree``), and which plain dicts were other mappings (``kinds``)."""

    tree: TreeSpec
    kinds: Optional[tuple]


def flatten_batch(batch: Any, examples: Optional[int] = None) -> tuple[list, BatchSpec]:
    """The batch's leaves (tensors and other values) and a picklable spec to rebuild it; with
    ``examples`` (the batch size), lists of that many plain values become :class:`PerExample` leaves."""
    plain, kinds = _plain(batch, examples)
    leaves, tree = tree_flatten(plain)
    return leaves, BatchSpec(tree, kinds)


def unflatten_batch(leaves: list, spec: BatchSpec) -> Any:
    """The batch ``flatten_batch`` described, with ``leaves`` in place of the original ones."""
    return _restore(tree_unflatten(leaves, spec.tree), spec.kinds)


def _foreign(obj: Any) -> bool:
    return isinstance(obj, Mapping) and type(obj) not in SUPPORTED_NODES


def _walked_dataclass(obj: Any) -> bool:
    """A dataclass instance its class can rebuild from its fields (no ``init=False`` field, no ``InitVar``)."""
    if not is_dataclass(obj) or isinstance(obj, type):
        return False
    return all(f.init for f in fields(obj)) and len(fields(obj)) == len(obj.__dataclass_fields__)


def _plain(obj: Any, examples: Optional[int] = None) -> tuple[Any, Optional[tuple]]:
    """``obj`` with foreign mappings (and dataclasses) turned into dicts and per-example lists into
    leaves; ``kinds`` records where (None: nothing to redo)."""
    if _per_example(obj, examples):
        return PerExample(tuple(obj)), ("examples",)
    if _walked_dataclass(obj):
        parts = {f.name: _plain(getattr(obj, f.name), examples) for f in fields(obj)}
        inner = {k: kind for k, (_, kind) in parts.items() if kind is not None}
        return {k: p for k, (p, _) in parts.items()}, ("dataclass", type(obj), inner)
    if _foreign(obj) or type(obj) is dict:
        parts = {k: _plain(v, examples) for k, v in obj.items()}
        inner = {k: kind for k, (_, kind) in parts.items() if kind is not None}
        plain = {k: p for k, (p, _) in parts.items()}
        if _foreign(obj):
            return plain, ("mapping", type(obj), inner)
        return plain, ("dict", inner) if inner else None
    if type(obj) in (list, tuple):
        parts = [_plain(v, examples) for v in obj]
        inner = {i: kind for i, (_, kind) in enumerate(parts) if kind is not None}
        plain = type(obj)(p for p, _ in parts)
        return plain, ("sequence", inner) if inner else None
    return obj, None


def _restore(plain: Any, kinds: Optional[tuple]) -> Any:
    if kinds is None:
        return plain
    if kinds[0] == "examples":
        return list(plain.values) if isinstance(plain, PerExample) else plain
    inner = kinds[-1]
    if kinds[0] == "sequence":
        return type(plain)(_restore(v, inner.get(i)) for i, v in enumerate(plain))
    items = {k: _restore(v, inner.get(k)) for k, v in plain.items()}
    if kinds[0] == "dict":
        return items
    if kinds[0] == "dataclass":
        return kinds[1](**items)
    try:
        return kinds[1](items)
    except TypeError:  # a mapping type that cannot be built from a dict stays a dict
        return items
