"""Is this checkpoint of THIS model and THIS optimizer? Answered from the metadata, before a
single tensor of the running job is overwritten.

A checkpoint of another model (other names or shapes) or another optimizer would otherwise
fail halfway through loading, after some weights were replaced, or, worse, load: an AdamW
state given to SGD is silently ignored. The errors list the first differing tensors and what
would work.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from megastrategy.errors import CheckpointMismatchError

__all__ = ["check_model_matches", "check_optimizers_match", "optimizer_record", "SHOWN"]

SHOWN = 5  # differences listed in a message


def model_differences(saved: dict[str, tuple], here: dict[str, tuple], *, whole: bool) -> tuple[list[str], list[str], list[str]]:
    """(shape differences, tensors the checkpoint lacks, tensors only the checkpoint has), in model order.

    ``whole``: ``here`` is the entire model (a pipeline stage is not: the other stages' tensors
    are legitimately in the checkpoint)."""
    shapes = [f"{name}: {tuple(saved[name])} in the checkpoint, {tuple(shape)} in this model"
              for name, shape in here.items() if name in saved and tuple(saved[name]) != tuple(shape)]
    missing = [name for name in here if name not in saved]
    extra = [name for name in saved if name not in here] if whole else []
    return shapes, missing, extra


def check_model_matches(path: Any, saved: dict[str, tuple], here: dict[str, tuple], *, strict: bool, whole: bool) -> None:
    """Raise :class:`CheckpointMismatchError` when the checkpoint cannot be this model's."""
    shapes, missing, extra = model_differences(saved, here, whole=whole)
    problems = []
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) differ in shape: " + "; ".join(shapes[:SHOWN]) + _more(shapes))
    if strict and missing:
        problems.append(f"{len(missing)} of this model's tensors are not in it: {missing[:SHOWN]}" + _more(missing))
    if strict and extra:
        problems.append(f"{len(extra)} of its tensors are not in this model: {extra[:SHOWN]}" + _more(extra))
    if not problems:
        return
    hint = " (shapes are compared unsharded and unpadded, whatever layout wrote it)" if shapes else ""
    loosen = "" if shapes else " To load only the matching tensors set LightningModule.strict_loading=False."
    raise CheckpointMismatchError(
        f"{path} is a checkpoint of another model: " + ". ".join(problems) + f"{hint}. Nothing was loaded; "
        "build the model with the architecture the checkpoint was saved with." + loosen
    )


def _more(items: Sequence[Any]) -> str:
    return f" (and {len(items) - SHOWN} more)" if len(items) > SHOWN else ""


def optimizer_record(optimizers: Sequence[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """What the checkpoint records to recognise its optimizers: type and number of parameter
    groups (not their sizes: a pipeline stage holds only its share of every group)."""
    return [{"type": type(user_optimizer(opt)).__name__, "groups": len(opt.param_groups)} for opt in optimizers]


def user_optimizer(opt: Any) -> Any:
    """The optimizer ``configure_optimizers`` built, under the wrappers that step it (ZeRO-1's
    ``DistributedOptimizer`` keeps it as ``user_optimizer``, Lightning's as ``_optimizer``): a
    checkpoint resumes with or without the distributed optimizer."""
    for attribute in ("user_optimizer", "_optimizer", "optimizer"):
        inner = getattr(opt, attribute, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not opt:
            return user_optimizer(inner)
    return opt


def check_optimizers_match(path: Any, saved: Any, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raise when the configured optimizers are not the ones the checkpoint holds the state of."""
    if not saved:
        return  # written before optimizers were recorded
    here = optimizer_record(optimizers)
    if len(saved) != len(here):
        raise CheckpointMismatchError(
            f"{path} holds the state of {len(saved)} optimizer(s) ({[s['type'] for s in saved]}), but "
            f"configure_optimizers returned {len(here)} ({[h['type'] for h in here]}); return the same optimizers "
            "as when it was saved, or load only the weights (LightningModule.load_from_checkpoint / "
            "megastrategy.checkpoint.load_model_)."
        )
    for i, (s, h) in enumerate(zip(saved, here)):
        if s["type"] != h["type"] or s["groups"] != h["groups"]:
            raise CheckpointMismatchError(
                f"{path}: optimizer {i} in the checkpoint is {s['type']} with {s['groups']} parameter group(s); "
                f"the configured one is {h['type']} with {h['groups']}. Its state "
                "(e.g. Adam's moments) means nothing to another optimizer or grouping: configure the same "
                "optimizer and groups, or load only the weights (LightningModule.load_from_checkpoint)."
            )
