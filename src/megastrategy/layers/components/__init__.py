"""The ``layers`` package's features as strategy components (see :mod:`megastrategy.component`)."""
from megastrategy.layers.components.recompute import Recompute
from megastrategy.layers.components.sequence_parallel import SequenceParallel
from megastrategy.layers.components.tensor_parallel import TensorParallel
from megastrategy.layers.components.transformer_engine import TransformerEngine

__all__ = ["Recompute", "SequenceParallel", "TensorParallel", "TransformerEngine"]
