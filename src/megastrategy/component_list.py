"""The strategy's components in order, and the few ways their hooks are combined.

A hook either runs on every component in order (``each``), threads a value through every
component (``chain``: loaders, batches, optimizers), or, for gradients, stops at the first
component that says the step must be skipped. Keeping those rules here leaves the strategy with
Lightning's lifecycle only.
"""
from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Iterator, Optional, Sequence, TypeVar

from megastrategy.component import Component

C = TypeVar("C", bound=Component)


class ComponentList(Sequence[Component]):
    """The enabled components, in the order their hooks run (teardown in reverse)."""

    def __init__(self, components: Sequence[Component]) -> None:
        self._items = tuple(c for c in components if c.enabled)

    def __getitem__(self, index):  # type: ignore[override]
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Component]:
        return iter(self._items)

    def find(self, kind: type[C]) -> Optional[C]:
        """The component of type ``kind`` in use, if any."""
        return next((c for c in self._items if isinstance(c, kind)), None)

    def each(self, hook: str, *args: Any) -> None:
        for c in self._items:
            getattr(c, hook)(*args)

    def chain(self, hook: str, value: Any, *args: Any) -> Any:
        """``value`` passed through ``hook`` of every component in order (each may replace it)."""
        for c in self._items:
            value = getattr(c, hook)(value, *args)
        return value

    def last_microbatch(self, stack: ExitStack, backward_passes: int) -> None:
        """Enter every component's context for the step's last backward (e.g. overlapped reduction)."""
        for c in self._items:
            stack.enter_context(c.last_microbatch_context(backward_passes))

    def finalize_grads(self) -> bool:
        """Finalize in order; at the first component that says skip, every gradient is zeroed."""
        for c in self._items:
            if not c.finalize_grads():
                self.each("zero_grads")
                return False
        return True

    def teardown(self) -> None:
        for c in reversed(self._items):
            c.teardown()
