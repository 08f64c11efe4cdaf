"""Context parallelism: each rank holds 1/cp of every sequence; attention runs as an exact ring."""
from megastrategy.context.context_parallel import ContextParallel
from megastrategy.context.layout import SequenceLayout
from megastrategy.context.validation import validate

__all__ = ["ContextParallel", "SequenceLayout", "validate"]
