"""Join the per-microbatch return values of a user's step into what one device returns for the batch.

Under pipeline parallelism the user's step runs once per microbatch (on every stage, see
:mod:`.model_calls`). Lightning must get one value for the batch: the training loss for the closure
and ``on_train_batch_end(outputs)``, the ``validation_step``/``predict_step`` output for
``on_validation_batch_end(outputs)`` and the prediction list. Microbatches have equal sizes, so
per leaf of the output (a tensor, dict, tuple, Hugging Face ``ModelOutput``):

* a tensor with a batch dimension (predictions, logits, labels: its first size is the
  microbatch's) is concatenated along dim 0;
* a 0-dim floating tensor or a float (a loss, a mean) is averaged; a 0-dim integer tensor or an
  int (a count) is summed; so is a tensor whose first size is not the microbatch's, a value for the
  whole batch (``loss.reshape(1)``, Lightning's ``BoringModel``-style ``predict_step``): concatenated,
  a batch of 4 in two microbatches returned two losses where one device returns one;
* a list of strings as long as the microbatch (decoded texts) is concatenated;
* any other value (a string, a flag) is kept when every microbatch gave the same, else the list
  of per-microbatch values is returned in its place.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from megastrategy.batch_tree import PerExample, flatten_batch, unflatten_batch
from megastrategy.errors import MegatronConfigError

__all__ = ["join_step_outputs"]


def join_step_outputs(outputs: list, step_name: str, sizes: Optional[list] = None) -> Any:
    """The whole batch's step output (detached) from ``outputs``, one per microbatch in order;
    ``sizes``: each microbatch's number of examples (``None``: every shaped tensor has a batch dimension)."""
    if all(o is None for o in outputs):
        return None
    counts = sizes if sizes is not None and len(sizes) == len(outputs) else [None] * len(outputs)
    flat = [flatten_batch(o, examples=n) for o, n in zip(outputs, counts)]
    spec = flat[0][1]
    if any(o is None for o in outputs) or any(s != spec for _, s in flat):
        raise MegatronConfigError(
            f"{step_name} returned differently structured values for the microbatches of one batch "
            f"({[type(o).__name__ for o in outputs]}); under pipeline parallelism they are joined into the "
            "batch's value, so return the same structure (e.g. always the loss, or always a dict with the same keys)."
        )
    columns = zip(*(leaves for leaves, _ in flat))
    return unflatten_batch([_join_leaf(list(values), sizes) for values in columns], spec)


def _per_example(tensors: list, sizes: Optional[list]) -> bool:
    """Whether shaped tensors carry the microbatches' examples along dim 0 (else: one value per microbatch)."""
    if sizes is None or len(sizes) != len(tensors):
        return True
    return all(t.shape[0] == n for t, n in zip(tensors, sizes)) or any(t.shape != tensors[0].shape for t in tensors)


def _join_leaf(values: list, sizes: Optional[list] = None) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        tensors = [v.detach() for v in values]
        if len(tensors) == 1:
            return tensors[0]
        if first.dim() > 0 and _per_example(tensors, sizes):
            return torch.cat(tensors)
        stacked = torch.stack(tensors)
        return stacked.mean(0) if stacked.is_floating_point() else stacked.sum(0)
    if all(isinstance(v, PerExample) for v in values):  # texts per example: in order, as one device's
        return PerExample(tuple(x for v in values for x in v.values))
    if isinstance(first, bool) or not isinstance(first, (int, float)):
        return first if all(_equal(v, first) for v in values) else values
    if isinstance(first, float):
        return sum(values) / len(values)
    return sum(values)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality count as different
        return False
