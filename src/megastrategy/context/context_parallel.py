"""Context parallelism for an unchanged model: split each microbatch's sequence over the cp
ranks and make attention, positions and token losses behave as on one device.

Life cycle (the strategy's component drives it)::

    ContextParallel.validate(model, cp)          # before any process group
    cp = ContextParallel(cp_group)
    cp.apply(model)                              # hooks; the model itself is untouched
    local = cp.transform_microbatch(batch, training=True)
    with cp.forward_context(local):
        loss = user_forward_and_loss(local)
    loss.backward()                              # ring backward; grads then AVERAGED over dp×cp
    cp.teardown()

Gradient convention: averaging every parameter's gradient over the dp×cp group gives exactly
the single-device gradient (token losses seed ``cp ×`` their share; see ``token_loss``).
"""
from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from megastrategy.context import hooks
from megastrategy.context.attention_dispatch import ActiveSplit, hf_attention, hf_mask
from megastrategy.context.function_mode import ContextParallelMode
from megastrategy.context.gather import gather_sequence
from megastrategy.context.hf_integration import HFAttentionSwitch, causal_lm_loss, hf_pretrained_models
from megastrategy.context.microbatch import split_microbatch
from megastrategy.context.positions import padding_index_numbering
from megastrategy.context.recompute import ReplayInSplit
from megastrategy.context.ring import Ring
from megastrategy.context.validation import gather_point, resolve_layout, resolve_output, validate

MICROBATCHES_KEPT = 64  # microbatches in flight at once (pipeline schedules) stay well below this


class ContextParallel:
    validate = staticmethod(validate)

    def __init__(self, cp_group, layout: str = "auto", output: str = "auto"):
        self.group = cp_group
        self.ring = Ring.of(cp_group)
        self.layout_choice, self.output_choice = layout, output
        self.layout: Optional[str] = None
        self.output: Optional[str] = None
        self._states: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
        self._active: Optional[ActiveSplit] = None
        self._mode: Optional[ContextParallelMode] = None
        self._replays = ReplayInSplit(self._current, self.replay)
        self._handles: list = []
        self._switch: Optional[HFAttentionSwitch] = None
        self._causal_lm = False
        self._padding_idx = None

    @property
    def size(self) -> int:
        return self.ring.size

    @property
    def rank(self) -> int:
        return self.ring.rank

    def _current(self) -> Optional[ActiveSplit]:
        return self._active

    def apply(self, model: nn.Module) -> None:
        """Install the hooks and the attention function; the model's code and weights are unchanged."""
        validate(model, self.size, self.layout_choice, self.output_choice)
        self.layout = resolve_layout(model, self.layout_choice)
        self.output = resolve_output(model, self.output_choice)
        self._causal_lm = any(causal_lm_loss(m) for _, m in hf_pretrained_models(model))
        self._padding_idx = padding_index_numbering(model)
        self._switch = HFAttentionSwitch(model, lambda module, *a, **kw: hf_attention(self._active, module, *a, **kw),
                                         lambda *a, **kw: hf_mask(self._active, *a, **kw))
        for module in hooks.input_modules(model):
            hook = hooks.input_hook(self._current, module)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        if self.output == "sequence":
            _, encoder = gather_point(model)
            self._handles.append(encoder.register_forward_hook(hooks.gather_hook(self._current, self.gather_sequence)))
        self._handles.extend(hooks.install_tracker(model, self._current))
        self._replays.install()

    def transform_microbatch(self, batch: Any, training: bool = True) -> Any:
        """This rank's part of ``batch``: every ``(batch, sequence, ...)`` tensor split along the sequence."""
        if self.layout is None:
            raise RuntimeError("ContextParallel.apply(model) must run before transform_microbatch")
        local, state = split_microbatch(batch, self.layout, self.size, self.rank, training, self._causal_lm,
                                        self._padding_idx)
        self._states[id(local)] = (local, state)
        while len(self._states) > MICROBATCHES_KEPT:
            self._states.popitem(last=False)
        return local

    @contextmanager
    def forward_context(self, local: Any):
        """Run the user's forward and loss on ``local`` (from :meth:`transform_microbatch`) as if unsplit."""
        entry = self._states.get(id(local))
        if entry is None or entry[0] is not local:
            raise RuntimeError("forward_context needs the exact object transform_microbatch returned")
        if self._active is not None:
            raise RuntimeError("forward_context is not re-entrant")
        with self._entered(ActiveSplit(entry[1], self.ring)) as split:
            yield split.state

    @contextmanager
    def replay(self, split: ActiveSplit):
        """Run a checkpoint's replay (recompute.py) in the split its forward ran in; inside that forward
        already (a backward called from the training step) only the function mode is made sure of."""
        if self._active is None:
            with self._entered(split):
                yield
            return
        if self._active is not split:
            raise RuntimeError("a checkpoint of one split microbatch was replayed during another one's forward")
        with nullcontext() if self._mode in _get_current_function_mode_stack() else self._mode_for(split):
            yield

    @contextmanager
    def _entered(self, split: ActiveSplit):
        """Everything a split forward needs: the split, ring attention in the configs, the function mode."""
        self._active = split
        self._switch.enter()
        try:
            with self._mode_for(split) as mode:
                self._mode = mode
                yield split
        finally:
            self._switch.exit()
            self._active, self._mode = None, None

    def _mode_for(self, split: ActiveSplit) -> ContextParallelMode:
        return ContextParallelMode(split, self.group, token_losses=self.output == "tokens")

    def gather_sequence(self, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence of a split activation, in global order (differentiable)."""
        if self._active is None:
            raise RuntimeError("gather_sequence runs inside forward_context (it needs the microbatch's layout)")
        return gather_sequence(local, self._active.state.layout, self.group, self.rank, dim)

    def teardown(self) -> None:
        """Remove every hook and the registered attention function."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._switch is not None:
            self._switch.remove()
            self._switch = None
        self._replays.remove()
        self._states.clear()
        self._active = None
