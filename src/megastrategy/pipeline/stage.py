"""Cut a pipeline stage out of the user's unchanged module.

The user's own ``forward``/``training_step`` runs on every stage. What changes is the module:
- the layer stack (an ``nn.ModuleList``) keeps only this rank's blocks, under their original
  indices, so state-dict names stay global;
- the first local block of a chunk takes its input from the previous stage (a forward pre-hook
  substitutes it), and the last local block ends the forward by raising :class:`StageBoundary`
  with its output, unless the chunk is the last virtual stage;
- modules registered before the stack exist for real only where the first virtual stage runs,
  and those registered after it only where the last one runs; elsewhere cheap stand-ins
  without parameters take their place, so memory is really split. Side inputs (masks,
  positions) are still recomputed from the microbatch on every stage by the user's code.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from megastrategy.anatomy import ModelAnatomy, find_layer_stack, get_submodule_path
from megastrategy.batch_tree import flatten_batch, unflatten_batch
from megastrategy.errors import MegatronConfigError

__all__ = ["PipelineStage", "StageBoundary", "cut_stage", "find_layer_stack", "iter_microbatches"]


class StageBoundary(BaseException):
    """Raised after a stage's last block to stop the user's forward; carries that block's output.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """

    def __init__(self, output: torch.Tensor):
        super().__init__("pipeline stage boundary")
        self.output = output


class LocalLayers(nn.ModuleList):
    """This stage's blocks, registered under their indices in the full stack (``"4"``, ``"5"``...)."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])

    def __getitem__(self, idx):
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]


class MetaStandIn(nn.Module):
    """Replaces a module that runs before the layer stack on stages that do not own it.

    Its output only needs the right shape (the first local block's input is substituted), so a
    parameter-free copy on the meta device computes the shape and zeros of that shape are returned.
    """

    def __init__(self, real: nn.Module, name: str):
        super().__init__()
        # Map every tensor to a meta twin before copying, so the copy never duplicates real memory.
        memo = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False) for t in real.parameters()}
        memo.update({id(t): torch.empty_like(t, device="meta") for t in real.buffers()})
        self._meta = [copy.deepcopy(real, memo)]  # a list: not registered as a submodule
        self._name = name
        self.stage_done = None  # set by the stage: says whether the stack has already run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage_done is not None and self.stage_done():
            raise MegatronConfigError(
                f"{self._name} is registered before the pipeline layer stack but was called after it; "
                "pipeline stages assign modules by registration order. Register it after the stack, "
                "or keep it inside a block."
            )
        device = next((a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
        with torch.no_grad():
            out = self._meta[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        return tree_map(
            lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t, out
        )


class Unreachable(nn.Module):
    """Replaces a module registered after the layer stack on stages that end before it."""

    def __init__(self, name: str):
        super().__init__()
        self._name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise MegatronConfigError(
            f"{self._name} is registered after the pipeline layer stack but was called before the stack "
            "finished on a stage that does not own it; pipeline stages assign modules by registration order."
        )


@dataclass
class _Swap:
    parent: nn.Module
    attr: str
    module: nn.Module


@dataclass
class PipelineStage:
    """The rank's share of the model: local blocks by chunk, and what each chunk must run with."""

    stack_path: str
    chunks: list[list[int]]  # chunk -> global layer indices
    pp_rank: int
    pp_size: int
    vp_size: int
    tied_parameters: list[nn.Parameter] = field(default_factory=list)
    # (name, module) whose calls from the user's step reach the stack or follow it (see model_calls.py)
    call_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    _chunk_swaps: list[list[_Swap]] = field(default_factory=list)
    _resting_swaps: list[_Swap] = field(default_factory=list)
    _pending_input: Optional[torch.Tensor] = None
    _stack_finished: bool = False
    _active_chunk: Optional[int] = None

    def is_first_virtual(self, chunk: int) -> bool:
        return self.pp_rank == 0 and chunk == 0

    def is_last_virtual(self, chunk: int) -> bool:
        return self.pp_rank == self.pp_size - 1 and chunk == self.vp_size - 1

    def activate(self, chunk: int, input_tensor: Optional[torch.Tensor]) -> None:
        """Arrange the module so that the user's forward runs exactly chunk ``chunk`` of this stage."""
        for swap in self._chunk_swaps[chunk]:
            setattr(swap.parent, swap.attr, swap.module)
        self._pending_input = input_tensor
        self._stack_finished = False
        self._active_chunk = chunk

    def deactivate(self) -> None:
        """Restore the rank's resting view: every local block and only the modules it owns,
        which is what ``parameters()``, optimizers and ``state_dict`` must see."""
        for swap in self._resting_swaps:
            setattr(swap.parent, swap.attr, swap.module)
        self._pending_input = None
        self._active_chunk = None

    def _pre_hook(self, module, args, kwargs):
        if self._active_chunk is None or self._pending_input is None:
            return None
        x, self._pending_input = self._pending_input, None
        if args:
            return (x, *args[1:]), kwargs
        first = next(iter(kwargs))
        return args, {**kwargs, first: x}

    def _post_hook(self, module, args, output):
        if self._active_chunk is None:
            return None
        self._stack_finished = True
        if self.is_last_virtual(self._active_chunk):
            return None
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if not isinstance(hidden, torch.Tensor):
            raise MegatronConfigError(
                f"the blocks of {self.stack_path} return {type(output).__name__}; pipeline stages need a tensor "
                "(or a tuple whose first element is the hidden-state tensor) to send to the next stage."
            )
        raise StageBoundary(hidden)


def cut_stage(
    module: nn.Module,
    *,
    stack_path: str,
    stack: nn.ModuleList,
    assignment: list[list[list[int]]],
    pp_rank: int,
    pp_size: int,
    vp_size: int,
    anatomy: Optional[ModelAnatomy] = None,
) -> PipelineStage:
    """Rewrite ``module`` in place into this rank's stage and return the handle that drives it."""
    anatomy = anatomy or ModelAnatomy.of(module, stack_path)
    chunks = assignment[pp_rank]
    stage = PipelineStage(stack_path=stack_path, chunks=chunks, pp_rank=pp_rank, pp_size=pp_size, vp_size=vp_size)
    parent_path, _, stack_attr = stack_path.rpartition(".")
    stack_parent = get_submodule_path(module, parent_path) if parent_path else module
    # Parameters shared between a module before the stack and one after it (a tied embedding):
    # the first and last stages each keep a copy, kept equal by an all-reduce of their gradients.
    stage.tied_parameters = list(anatomy.tied_parameters)

    holds_first = pp_rank == 0
    holds_last = pp_rank == pp_size - 1
    pre_swaps_real = [_Swap(o.parent, o.attr, o.module) for o in anatomy.pre]
    pre_swaps_stand = [_Swap(o.parent, o.attr, MetaStandIn(o.module, o.name)) for o in anatomy.pre]
    post_swaps_real = [_Swap(o.parent, o.attr, o.module) for o in anatomy.post]
    post_swaps_stand = [_Swap(o.parent, o.attr, Unreachable(o.name)) for o in anatomy.post]
    for s in pre_swaps_stand:
        s.module.stage_done = lambda: stage._stack_finished

    stage.call_modules = _call_modules(module, stack_path, anatomy)
    stage.call_modules += [(s.module._name, s.module) for s in post_swaps_stand]
    all_layers = LocalLayers({i: stack[i] for chunk in chunks for i in chunk})
    for c, chunk in enumerate(chunks):
        swaps = [_Swap(stack_parent, stack_attr, LocalLayers({i: stack[i] for i in chunk}))]
        swaps += pre_swaps_real if stage.is_first_virtual(c) else pre_swaps_stand
        swaps += post_swaps_real if stage.is_last_virtual(c) else post_swaps_stand
        stage._chunk_swaps.append(swaps)
        stack[chunk[0]].register_forward_pre_hook(stage._pre_hook, with_kwargs=True)
        stack[chunk[-1]].register_forward_hook(stage._post_hook)

    # At rest the rank holds its blocks and only the outside modules it runs for real; the rest
    # are dropped here, which is what frees their memory.
    stage._resting_swaps = [_Swap(stack_parent, stack_attr, all_layers)]
    stage._resting_swaps += pre_swaps_real if holds_first else pre_swaps_stand
    stage._resting_swaps += post_swaps_real if holds_last else post_swaps_stand
    stage.deactivate()
    if not holds_first:
        stage.tied_parameters = [p for p in stage.tied_parameters if holds_last]
    return stage


def _call_modules(root: nn.Module, stack_path: str, anatomy: ModelAnatomy) -> list[tuple[str, nn.Module]]:
    """The stack's ancestors (the user's step reaches the stack through one of them) and the real
    modules registered after it (a step may call a head itself)."""
    parts = stack_path.split(".")
    ancestors = [(".".join(parts[:i]), get_submodule_path(root, ".".join(parts[:i])) if i else root) for i in range(len(parts))]
    return ancestors + [(o.name, o.module) for o in anatomy.post]


def iter_microbatches(batch: Any, num_microbatches: int) -> Iterator[Any]:
    """Split every tensor of ``batch`` along dim 0 into ``num_microbatches`` equal parts."""
    leaves, spec = flatten_batch(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if not sizes:
        raise MegatronConfigError("the batch holds no tensor to split into microbatches.")
    if len(sizes) > 1:
        raise MegatronConfigError(
            f"the batch's tensors have different sizes along dim 0 ({sorted(sizes)}); microbatching splits "
            "every tensor along dim 0, so they must share the batch size."
        )
    size = sizes.pop()
    if size % num_microbatches:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise MegatronConfigError(
            f"num_microbatches={num_microbatches} does not divide the batch size {size}; "
            f"use a batch size that is a multiple of {num_microbatches}, or num_microbatches in {divisors}."
        )
    step = size // num_microbatches
    for m in range(num_microbatches):
        yield unflatten_batch(
            [leaf[m * step : (m + 1) * step] if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf for leaf in leaves],
            spec,
        )
