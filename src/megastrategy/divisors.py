"""Divisors of a size, used to suggest the parallel sizes that would fit in error messages."""
from __future__ import annotations

__all__ = ["divisors"]


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n``, ascending (``[]`` for ``n < 1``)."""
    return [d for d in range(1, n + 1) if n % d == 0]
