"""In setup, catch what the first step's stand-in checks would refuse: a module before the stack
that cannot run on the meta device, or a value computed before the stack read past the cut.

The stages after the first replace the modules the forward calls before the layer stack with
:class:`~.stage.MetaStandIn`\\ s (zeros of the right shape, from a meta run), and the first forward
of each chunk refuses a stand-in's value reaching a block's inputs (:mod:`.stand_in_values`).
Found only then, the refusal costs the user a launch and, on a cluster, a queue wait. So setup
replays it on the dry run's meta twin (:mod:`.forward_order`), for every stage at once: the outputs
of the modules that would be stood in are marked, the hidden state (and what the previous block
carries) entering each block that starts a stage after the first is unmarked, as the previous
stage's activation replaces it; a mark reaching a block of a later stage, or a module after the
stack, is refused with the same message the step would give. A twin that fails inside a module to
be stood in is refused as its stand-in would fail. A twin that cannot run tells nothing: the step's
checks remain.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from megastrategy.anatomy import ModelAnatomy
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.forward_order import ForwardOrder, dry_run_twin, dry_run_variants
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.router_logits import map_recorded_router_logits
from megastrategy.pipeline.stage import no_meta_run_message
from megastrategy.pipeline.stand_in_values import mark, refuse_if_marked, sources_of, stage_place

__all__ = ["refuse_stand_in_values"]


def refuse_stand_in_values(module: nn.Module, anatomy: ModelAnatomy, order: Optional[ForwardOrder],
                           assignment: list[list[list[int]]], placement: Optional[StagePlacement]) -> None:
    """Raise the step's stand-in refusal now, when the dry run's twin shows it would come."""
    if order is not None and order.reuses_blocks:  # applications, not blocks, are split: the step checks
        return
    dry = dry_run_twin(module, anatomy.stack_path)
    if dry is None:
        return
    twin, inputs, prefix, args = dry
    stand_ins = [o.name[len(prefix):] for o in anatomy.pre if o.name.startswith(prefix)]
    later = _later_stage_blocks(assignment, placement)
    failure, active = None, []
    # a stand-in's meta run answers no question on values (inside one the twin must not either)
    for variant, mode in dry_run_variants(twin, inputs, answer=lambda: not active):
        active.clear()  # a failed try may have left a stand-in entered
        probe = _Probe(twin, anatomy.stack_path[len(prefix):], stand_ins, later, prefix, active,
                       carried=order.carried if order else ())
        probe.check_inputs_of([o.name[len(prefix):] for o in anatomy.post
                               if o.name.startswith(prefix) and o.name[len(prefix):] not in stand_ins])
        try:
            with mode:
                probe.run(args, variant)
            return
        except MegatronConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a forward that needs real data tells nothing
            failure = (probe.failed_in, exc) if probe.failed_in and _reads_meta_values(exc) else None
        finally:
            probe.remove()
    if failure is not None:
        name, exc = failure
        raise MegatronConfigError(no_meta_run_message(prefix + name, twin.get_submodule(name), exc)) from exc


def _reads_meta_values(exc: Exception) -> bool:
    """Whether ``exc`` says an op needed the values of a meta tensor (I-BERT's ``.item()``), which
    the stand-in's meta run would need too; a shape error says only that the dry run's made-up input
    (its image size, say) is not the user's, so it tells nothing."""
    return isinstance(exc, (RuntimeError, NotImplementedError)) and "meta" in str(exc).lower()


def _later_stage_blocks(assignment: list[list[list[int]]], placement: Optional[StagePlacement]) -> dict[int, tuple[bool, int]]:
    """Block index -> (whether it starts its chunk, where it runs: :func:`stage_place`), for the
    blocks of every stage after the first."""
    pp, vp = len(assignment), max(len(chunks) for chunks in assignment)
    where = placement or StagePlacement.build("ring", pp, vp)
    return {block: (i == 0, stage_place(where.stage(rank, c), rank, vp)) for rank, chunks in enumerate(assignment)
            for c, chunk in enumerate(chunks) if where.stage(rank, c) != 0 for i, block in enumerate(chunk)}


class _Probe:
    """Hooks on the twin: marks on the stand-ins' outputs, unmarking at stage starts, checks."""

    def __init__(self, twin: nn.Module, stack_rel: str, stand_ins: list[str], later: dict[int, bool], prefix: str,
                 active: list, carried: tuple = ()):
        self.twin, self.failed_in, self._active, self._prefix = twin, None, active, prefix
        self._carried = {name for _, name in carried}
        self._handles = []
        for name in stand_ins:
            sub = twin.get_submodule(name)
            self._handles.append(sub.register_forward_pre_hook(lambda m, a, n=name: self._active.append(n)))
            self._handles.append(sub.register_forward_hook(self._marker(prefix + name)))
        stack = twin.get_submodule(stack_rel)
        self._last_place = later[max(later)][1] if later else "the last pipeline stage"
        for index, (starts, place) in later.items():
            where = f"{prefix}{stack_rel}.{index} (on its inputs)"
            check = self._checker(where, starts, place)
            self._handles.append(stack[index].register_forward_pre_hook(check, with_kwargs=True))

    def check_inputs_of(self, names: list[str]) -> None:
        """Refuse a mark reaching these modules (the ones after the stack, on the last stage)."""
        for name in names:
            where = f"{self._prefix}{name} (on its inputs)"
            hook = lambda m, a, k, w=where: refuse_if_marked((a, k), w, self._last_place)  # noqa: E731
            self._handles.append(self.twin.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))

    def _marker(self, name: str):
        def hook(module, args, output):
            self._active.pop()
            return tree_map(lambda t: mark(t, [name]) if isinstance(t, torch.Tensor) else t, output)

        return hook

    def _checker(self, where: str, starts: bool, place: str):
        def hook(block, args, kwargs):
            if starts:  # the previous stage's activation (and what it carries) replaces these
                map_recorded_router_logits(_plain)  # carried too (a model with output_router_logits)
                args = (_plain(args[0]), *args[1:]) if args else args
                kwargs = {k: _plain(v) if (k in self._carried or (not args and i == 0)) else v
                          for i, (k, v) in enumerate(kwargs.items())}
            refuse_if_marked((args, kwargs), where, place)
            return args, kwargs

        return hook

    def run(self, args: tuple, inputs: dict) -> None:
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                output = self.twin(*args, **inputs)
        except Exception:
            self.failed_in = self._active[-1] if self._active else None
            raise
        refuse_if_marked(_logits(output), "the model's output on the last stage", self._last_place)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _plain(value: Any) -> Any:
    """``value`` with the marks removed (a stage's input comes from the previous stage)."""
    return tree_map(lambda t: t.as_subclass(torch.Tensor) if sources_of(t) else t, value)


def _logits(output: Any) -> Any:
    """What the head computes from the stack's output (not the hidden states a model may also return)."""
    if isinstance(output, dict):
        return [v for k, v in output.items() if "hidden_state" not in k and "attention" not in k]
    return output
