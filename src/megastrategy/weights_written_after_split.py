"""Weights the user writes between the split and the first training step: exact, or refused.

Lightning calls ``on_fit_start``, the sanity check, ``on_train_start``, ``on_train_epoch_start`` and
``on_train_batch_start`` after the strategy's ``setup`` has split the module. Code there that draws
weights (``nn.init.normal_`` in an ``isinstance(m, nn.Linear)`` loop, ``reset_parameters()``) runs on
the split model: under tensor parallelism the sharded layers are not ``nn.Linear`` (the loop skips them,
the model trains as built) and a shard drawn alone is not a slice of one device's draw; under pipeline
(or expert) parallelism each rank draws only its own layers, from another place in the random stream.
Both trained silently other weights than one device (21.86 against DDP's 4.61 at tp2).

So the values of every parameter are fingerprinted once the split model is set up (and again after the
strategy itself writes them: a checkpoint restore, ``LearningRateFinder``'s), and compared at the first
training step. A written parameter on a split layout is refused on every rank, naming it; a constant fill
(``zeros_``, ``ones_``, ``constant_``) is the same on every shard and stage, so it is let through. Values,
not ``p._version``, are compared: ``p.data.normal_()`` leaves the version alone, and Lightning's own
swaps (an EMA's weights validated, then put back) change it without changing a value.

Without a split (data and context parallelism) a write is exact, as under DDP; a written parameter only
has its fp32 main copy (``bf16-true``, ZeRO-1 of half-precision weights) reloaded, or the first optimizer
step would put the old weights back. Sharded layers that a loop skipped write nothing: the hooks'
source is read for random initializers instead (:mod:`megastrategy.hooks_that_initialize`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megastrategy.component import Component, SetupContext, StepInfo
from megastrategy.config import MegatronConfig
from megastrategy.ddp.distributed_optimizer import DistributedOptimizer
from megastrategy.errors import MegatronConfigError
from megastrategy.hooks_that_initialize import WINDOW_HOOKS, random_initializers_in_hooks

__all__ = ["WeightsWrittenAfterSplit", "fingerprints", "written"]

_NAMED = 6  # parameters named per rank in a refusal


def fingerprints(params: list[Tensor]) -> Tensor:
    """``[len(params), 3]`` float64 on the parameters' device: each one's sum, norm and strided sum
    (a re-draw, a scaling or a permutation changes one of them; one pass over the weights, no copy)."""
    real = [p for p in params if not p.is_meta]
    device = real[0].device if real else torch.device("cpu")
    rows = []
    for p in params:
        t = p.detach()
        if t.is_meta:  # holds no values (a stand-in): nothing to write
            rows.append(torch.zeros(3, dtype=torch.float64, device=device))
            continue
        rows.append(torch.stack([t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, dtype=torch.float64),
                                 t.reshape(-1)[::7].sum(dtype=torch.float64)]).to(device))
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


def written(before: Tensor, after: Tensor) -> list[bool]:
    """Per row: whether ``after`` differs from ``before`` (NaN equal to NaN)."""
    same = (before == after) | (before.isnan() & after.isnan())
    return [not bool(v) for v in same.all(dim=1).cpu()]


def _constant(p: Tensor) -> bool:
    """A fill the same everywhere (zeros_, ones_, constant_): every shard of it is one device's."""
    t = p.detach()
    return t.numel() == 0 or t.is_meta or bool((t == t.reshape(-1)[0]).all())


def _split_of(config: MegatronConfig) -> str:
    """``"tp=2, pp=1, ep=1"`` when the model is split over ranks, ``""`` when every rank holds all of it."""
    return f"tp={config.tp}, pp={config.pp}, ep={config.ep}" if config.tp * config.pp * config.ep > 1 else ""


class WeightsWrittenAfterSplit(Component):
    """Fingerprints at the end of ``setup`` (``wrap_optimizers``) and after the strategy's restores
    (``on_weights_loaded``); compares at the first training step (``begin_step``)."""

    def __init__(self, config: MegatronConfig) -> None:
        self.split = _split_of(config)
        self.sharded_layers = config.tp > 1 or config.ep > 1  # layer classes a user's isinstance loop misses
        self._module: Optional[nn.Module] = None
        self._optimizers: Optional[list] = None  # set when fitting (wrap_optimizers), possibly empty
        self._named: list[tuple[str, nn.Parameter]] = []
        self._baseline: Optional[Tensor] = None

    def configure(self, ctx: SetupContext) -> None:
        self._module = ctx.module

    def wrap_optimizers(self, optimizers: list) -> list:
        self._optimizers = list(optimizers)
        self._arm()
        return optimizers

    def on_weights_loaded(self) -> None:
        if self._module is not None and self._optimizers is not None:
            self._arm()  # a restore after the split (LearningRateFinder, a resume) starts a new window

    def begin_step(self, module: nn.Module, step: StepInfo) -> None:
        if step.training and self._baseline is not None:
            self._check()

    def teardown(self) -> None:
        self._module, self._optimizers, self._named, self._baseline = None, None, [], None

    # ------------------------------------------------------------------ the window
    def _arm(self) -> None:
        if not self.split and not _main_copies(self._optimizers):
            self._baseline = None  # every write is exact and reaches the optimizer: nothing to watch
            return
        self._named = list(self._module.named_parameters())
        self._baseline = fingerprints([p for _, p in self._named])

    def _check(self) -> None:
        now = dict(self._module.named_parameters())
        current = [now.get(name, p) for name, p in self._named]
        changed = written(self._baseline, fingerprints(current))
        changed = [c or now.get(name) is not p for c, (name, p) in zip(changed, self._named)]
        self._baseline = None
        params = [p for p, c in zip(current, changed) if c]
        if self.split:
            drawn = [name for (name, _), p, c in zip(self._named, current, changed) if c and not _constant(p)]
            self._refuse_if_written(drawn)
        _reload_main_copies(self._optimizers, params)

    def _refuse_if_written(self, drawn: list[str]) -> None:
        every = _gathered((len(drawn), drawn[:_NAMED]))
        hooks = random_initializers_in_hooks(self._module) if self.sharded_layers else []
        if any(count for count, _ in every) or hooks:
            raise MegatronConfigError(_refusal(self.split, every, hooks))


def _main_copies(optimizers: list) -> bool:
    return any(isinstance(o, DistributedOptimizer) and o.has_main_copies for o in optimizers)


def _reload_main_copies(optimizers: list, params: list[Tensor]) -> None:
    """The written parameters' fp32 main copies take their new values (the user's write wins, as under DDP)."""
    if params:
        for o in optimizers:
            if isinstance(o, DistributedOptimizer):
                o.reload_main_params(params)


def _gathered(mine: tuple) -> list[tuple]:
    """Every rank's ``mine``, in rank order (one collective over the world; no collective alone)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _refusal(split: str, every: list[tuple], hooks: list[str]) -> str:
    where = "; ".join(f"rank {r}: {', '.join(names)}" + (f" and {n - len(names)} more" if n > len(names) else "")
                      for r, (n, names) in enumerate(every) if n)
    found = (f"parameters were written ({where})" if where else "no parameter was written") + (
        f"; the hooks call random initializers ({'; '.join(hooks)})" if hooks else "")
    return (
        f"{split}: weights were initialized between the split and the first training step ({', '.join(WINDOW_HOOKS)} "
        f"of the module or a callback, the sanity check): {found}. These hooks run after the strategy split the "
        "model: each rank holds only its shards or its stage's layers, so a draw there is not one device's (a "
        "stage draws its layers from the start of the random stream, a shard is not a slice of the whole "
        "tensor's draw, and sharded layers are not nn.Linear/nn.Embedding, so an isinstance loop skips them and "
        "they keep their values). What works: initialize in __init__, setup() or configure_model() (before the "
        "split), or load the weights before fit (module.load_state_dict, fit(ckpt_path=...)); constant fills "
        "(nn.init.zeros_/ones_/constant_) are exact here and allowed."
    )
