"""Cut a pipeline stage out of the user's unchanged module.

The user's own ``forward``/``training_step`` runs on every stage. What changes is the module:
- the layer stack (an ``nn.ModuleList``) keeps only this rank's blocks, under their original
  indices, so state-dict names stay global;
- the first local block of a chunk takes its input from the previous stage (a forward pre-hook
  substitutes it), and the last local block ends the forward by raising :class:`StageBoundary`
  with its output, unless the chunk is the last virtual stage;
- modules the forward calls before the stack (:mod:`.forward_order`; else those registered
  before it) exist for real only where the first virtual stage runs, and those called after it
  only where the last one runs; elsewhere cheap stand-ins without parameters take their place,
  so memory is really split. Side inputs (masks, positions) are still recomputed from the
  microbatch on every stage by the user's code; what a block hands the next one besides the
  hidden state crosses the boundary with it (:mod:`.boundary_pack`);
- a block the forward applies several times is split by applications (:mod:`.reused_layers`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from megastrategy.anatomy import ModelAnatomy, find_layer_stack, get_submodule_path
from megastrategy.batch_tree import PerExample, flatten_batch, unflatten_batch
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.boundary_pack import pack, unpack
from megastrategy.pipeline.forward_order import MetaAttributes, block_outputs, meta_copy
from megastrategy.pipeline.leading_blocks import skipped_blocks
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.reused_layers import ReusedLayers
from megastrategy.pipeline.router_logits import RouterLogitsCarry
from megastrategy.pipeline.stand_in_values import mark, refuse_if_marked, stage_place

__all__ = ["PipelineStage", "StageBoundary", "cut_stage", "find_layer_stack", "iter_microbatches"]


class StageBoundary(BaseException):
    """Raised after a stage's last block to stop the user's forward; carries that block's output.

    A ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """

    def __init__(self, output: torch.Tensor):
        super().__init__("pipeline stage boundary")
        self.output = output


class LocalLayers(nn.ModuleList):
    """This stage's blocks, registered under their indices in the full stack (``"4"``, ``"5"``...).

    ``leading``: for a chunk's view, placeholders of the blocks before the chunk (not registered,
    :mod:`.leading_blocks`). Iterating, indexing and ``len`` see them first, so the forward's loop
    counts blocks by their global index (``config.layer_types[i]`` picks each block's mask).
    """

    def __init__(self, layers: dict[int, nn.Module], leading: Optional[list[nn.Module]] = None):
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])
        self._leading = list(leading or [])  # a list, not registered: no parameters, not in state_dict

    def _view(self) -> list[nn.Module]:
        return self._leading + list(self._modules.values())

    def __len__(self) -> int:
        return len(self._leading) + len(self._modules)

    def __iter__(self):
        return iter(self._view())

    def __getitem__(self, idx):
        values = self._view()
        if isinstance(idx, slice):
            return _LeadingView(values[idx])
        return values[idx]


class LocalSequence(LocalLayers):
    """:class:`LocalLayers` for a stack held in an ``nn.Sequential`` (timm's ``self.blocks(x)``):
    calling it runs the view's blocks one after the other, as the Sequential did."""

    def forward(self, hidden: Any) -> Any:
        for block in self:
            hidden = block(hidden)
        return hidden


class _LeadingView(nn.ModuleList):
    """A slice of a chunk's view (``self.layers[: config.num_hidden_layers]``), stand-ins included,
    without registering them (so it holds exactly the parameters of the blocks it contains)."""

    def __init__(self, values: list[nn.Module]):
        super().__init__()
        self._values = values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self):
        return iter(self._values)

    def __getitem__(self, idx):
        return _LeadingView(self._values[idx]) if isinstance(idx, slice) else self._values[idx]


class MetaStandIn(MetaAttributes, nn.Module):
    """Replaces a module that runs before the layer stack on stages that do not own it.

    Its output only needs the right shape (the first local block's input is substituted), so a
    parameter-free copy on the meta device computes the shape and zeros of that shape are returned.
    The meta run costs milliseconds per call (it dispatches every op with shape checks), so its
    result is kept per input signature (the shapes, dtypes and devices of the tensor arguments and
    the other arguments' values): a meta tensor's shape cannot depend on the data anyway.
    """

    def __init__(self, real: nn.Module, name: str, by_registration: bool = False):
        super().__init__()
        self._meta = [meta_copy(real)]  # a list: not registered as a submodule
        #: where the zeros go when the inputs are on the meta device: Llama 4 moves the token ids to
        #: ``embed_tokens.weight.device``, which the stand-in answers from its meta copy
        self._device = next((t.device for t in list(real.parameters()) + list(real.buffers())), None)
        self._name = name
        self._by_registration = by_registration
        self._outputs: dict[Any, Any] = {}  # input signature -> the meta run's output
        self.stage_done = None  # set by the stage: says whether the stack has already run
        self.marking = None  # set by the stage: says whether to mark the zeros (:mod:`.stand_in_values`)
        self._running = False  # inside this stand-in's own meta run
        for sub_name, sub in self._meta[0].named_modules():
            if sub_name:
                sub.register_forward_pre_hook(self._refuse_direct_call(sub_name))

    def _refuse_direct_call(self, sub_name: str):
        """A pre-hook for the meta copy's submodules: the forward may read them (shapes, dtypes)
        but a call from outside the stand-in's own run would compute on the meta device."""

        def check(module: nn.Module, args: Any) -> None:
            if not self._running:
                raise MegatronConfigError(
                    f"the forward calls {self._name}.{sub_name} directly on a pipeline stage that does not own "
                    f"{self._name} (it runs before the layer stack, on the first stage only); pipeline stages place "
                    f"a module by where the forward calls it. Call {self._name} itself, or use pp=1."
                )

        return check

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage_done is not None and self.stage_done():
            raise MegatronConfigError(misplaced_call(self._name, "before", self._by_registration))
        device = next((a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
        device = self._device if device is not None and device.type == "meta" else device
        key = _signature((args, kwargs))
        out = self._outputs.get(key) if key is not None else None
        if out is None:
            to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
            self._running = True
            try:
                with torch.no_grad():
                    out = self._meta[0](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
            except (RuntimeError, NotImplementedError) as exc:
                raise MegatronConfigError(no_meta_run_message(self._name, self._meta[0], exc)) from exc
            finally:
                self._running = False
            if key is not None:
                if len(self._outputs) >= _MAX_SIGNATURES:
                    self._outputs.clear()
                self._outputs[key] = out
        marked = self.marking is not None and self.marking()
        return tree_map(lambda t: self._zeros(t, device, marked) if isinstance(t, torch.Tensor) else t, out)

    def _zeros(self, like: torch.Tensor, device: Optional[torch.device], marked: bool) -> torch.Tensor:
        zeros = torch.zeros(like.shape, dtype=like.dtype, device=device)
        return mark(zeros, [self._name]) if marked else zeros


def no_meta_run_message(name: str, module: nn.Module, exc: Exception) -> str:
    """Why a module before the stack cannot be stood in for (I-BERT's quantized embeddings read values)."""
    first = (str(exc).strip().splitlines() or ["(no message)"])[0]
    return (f"{name} ({type(module).__name__}) runs before the pipeline layer stack; the stages after the first "
            f"compute only the shape of its output, on the meta device (no values), and its forward needs values "
            f"there ({type(exc).__name__}: {first}). Use pp=1 for this model (tensor, context and data parallelism "
            f"work), or keep what reads values (.item(), asserts on data) out of the modules before the stack.")


class _NotFlat(Exception):
    pass


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad)
    if isinstance(leaf, _PLAIN_VALUES):
        return (type(leaf), leaf)
    raise _NotFlat


def _signature(value: Any) -> Any:
    """A hashable key for what a meta run's output can depend on; ``None`` when an argument is an
    object other than a tensor or a plain value.

    Called once per microbatch, so the usual call (every argument a tensor or a plain value, as
    an embedding's) is keyed without flattening: a pytree spec's text costs far more than the
    lookup it serves."""
    args, kwargs = value
    try:
        return ("flat", tuple(_leaf_key(a) for a in args), tuple((k, _leaf_key(v)) for k, v in kwargs.items()))
    except _NotFlat:
        pass
    leaves, spec = flatten_batch(value)
    key = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
        elif isinstance(leaf, _PLAIN_VALUES):
            key.append((type(leaf), leaf))
        else:  # an object (a cache, a config): its identity would make every call a new key
            return None
    return tuple(key)


_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device)
_MAX_SIGNATURES = 64  # distinct input shapes remembered per stand-in (sequence lengths vary)


class UnreachableAttributeError(MegatronConfigError, AttributeError):
    """A stage read a parameter (or other attribute) of a module it does not own. An
    ``AttributeError`` too, so ``hasattr``/``getattr(..., default)`` probes still answer no."""


class Unreachable(nn.Module):
    """Replaces a module registered after the layer stack on stages that end before it."""

    def __init__(self, name: str, by_registration: bool = False):
        super().__init__()
        self._name = name
        self._by_registration = by_registration

    def __getattr__(self, attr: str) -> Any:
        """Reading e.g. ``.weight`` instead of calling the module (DeBERTa-v2's relative position
        embeddings, read by every layer) would need that parameter on every stage, with its
        gradients summed across them: refused rather than guessed."""
        try:
            return super().__getattr__(attr)
        except AttributeError:
            pass
        what = f"{self._name}{'' if attr.startswith('[') else '.'}{attr}"
        raise UnreachableAttributeError(
            f"{what} was read on a pipeline stage that does not own {self._name} (pipeline stages place a module by "
            "where the forward calls it; this stage holds a stand-in). In the model's forward (reading it without "
            f"calling {self._name}): a module whose parameters every layer reads (shared relative-position "
            "embeddings, as in DeBERTa-v2) cannot be split across stages; use pp=1 (tensor or data parallelism "
            "work), or call the module instead of reading its attributes. In a hook or callback (parameter "
            "statistics logged from rank 0): read it where it lives, e.g. iterate over self.named_parameters(), "
            "which holds this stage's parameters, or log from every rank."
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise MegatronConfigError(misplaced_call(self._name, "after", self._by_registration))

    def _indexed(self, *_: Any) -> Any:
        """Indexing or iterating a container (a ModuleList of heads, MarkupLM's and PoolFormer's) this
        stage does not own: refused like an attribute read, not a bare TypeError."""
        return self.__getattr__("[...]")

    __getitem__ = __iter__ = __len__ = _indexed

    def __bool__(self) -> bool:
        """``if self.pooler:`` still sees a module (``bool`` would otherwise ask ``__len__``)."""
        return True


def misplaced_call(name: str, placed: str, by_registration: bool) -> str:
    """Why a module placed on one side of the layer stack cannot run on the other, and the fix."""
    called = "after" if placed == "before" else "before the stack finished"
    if not by_registration:
        return (f"{name} ran {placed} the pipeline layer stack in the dry run of the forward but was called {called}; "
                "pipeline stages place a module by where the forward calls it. Call it on one side of the stack "
                "only, or keep it inside a block.")
    move = "below" if placed == "before" else "above"
    return (f"{name} is registered {placed} the module holding the pipeline layer stack, so pipeline stages place "
            f"it {placed} the stack (a module no dry run of a Hugging Face model's forward sees is placed by where it "
            f"is registered, in the order of your __init__), but the step calls it {called}, on a stage that does not "
            "hold it. "
            f"Move the line that creates it {move} the line that creates the model in __init__, so that the "
            "registration order is the order the step uses them.")


@dataclass
class _Swap:
    parent: nn.Module
    attr: str
    module: nn.Module


@dataclass
class PipelineStage:
    """The rank's share of the model: local blocks by chunk, and what each chunk must run with.

    ``chunks`` holds, per chunk, the indices of the stack's *applications* this rank runs; they
    are the block indices unless the forward applies a block more than once (``stack_calls``,
    see :mod:`.reused_layers`).
    """

    stack_path: str
    chunks: list[list[int]]  # chunk -> global layer (application) indices
    pp_rank: int
    pp_size: int
    vp_size: int
    tied_parameters: list[nn.Parameter] = field(default_factory=list)  # every copy kept equal to another stage's
    shared_layer_parameters: list[nn.Parameter] = field(default_factory=list)  # of blocks applied on several stages
    stack_calls: Optional[tuple[int, ...]] = None  # block of each application, when blocks are reused
    carried: tuple[tuple[int, str], ...] = ()  # (output index, argument) a block hands the next besides the hidden
    router_logits: Optional[RouterLogitsCarry] = None  # the router logits recorded so far cross each boundary too
    placement: Optional[StagePlacement] = None  # which stage each (rank, chunk) runs; None: the ring
    # (name, module) whose calls from the user's step reach the stack or follow it (see model_calls.py)
    call_modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    _chunk_swaps: list[list[_Swap]] = field(default_factory=list)
    _resting_swaps: list[_Swap] = field(default_factory=list)
    _pending_input: Optional[torch.Tensor] = None
    _stack_finished: bool = False
    _active_chunk: Optional[int] = None
    _applications: int = 0
    _forward_parameters: dict = field(default_factory=dict)  # forward function -> its parameter names
    # The first forward of each chunk marks the stand-ins' zeros and checks where they go (:mod:`.stand_in_values`)
    probing: bool = False
    _probed_chunks: set = field(default_factory=set)
    _probe_targets: list = field(default_factory=list)  # chunk -> (name, module) whose inputs are checked
    _probe_hooks: list = field(default_factory=list)
    # called as a chunk's first block starts in the schedule (the step runner checks how the step got there)
    on_stack_entry: Optional[Callable[[], None]] = None

    def is_first_virtual(self, chunk: int) -> bool:
        return self._where().stage(self.pp_rank, chunk) == 0

    def is_last_virtual(self, chunk: int) -> bool:
        where = self._where()
        return where.stage(self.pp_rank, chunk) == where.num_stages - 1

    def _where(self) -> StagePlacement:
        if self.placement is None:
            self.placement = StagePlacement.build("ring", self.pp_size, self.vp_size)
        return self.placement

    @property
    def active_chunk(self) -> Optional[int]:
        return self._active_chunk

    def activate(self, chunk: int, input_tensor: Optional[torch.Tensor]) -> None:
        """Arrange the module so that the user's forward runs exactly chunk ``chunk`` of this stage."""
        for swap in self._chunk_swaps[chunk]:
            setattr(swap.parent, swap.attr, swap.module)
        self._pending_input = input_tensor
        self._stack_finished = False
        self._active_chunk = chunk
        self._applications = 0
        self.probing = chunk not in self._probed_chunks
        if self.probing:
            self._probe_hooks = [module.register_forward_pre_hook(self._input_check(name), with_kwargs=True)
                                 for name, module in self._probe_targets[chunk]]

    def deactivate(self) -> None:
        """Restore the rank's resting view: every local block and only the modules it owns,
        which is what ``parameters()``, optimizers and ``state_dict`` must see."""
        for swap in self._resting_swaps:
            setattr(swap.parent, swap.attr, swap.module)
        if self.probing:
            self._probed_chunks.add(self._active_chunk)
            for hook in self._probe_hooks:
                hook.remove()
            self._probe_hooks, self.probing = [], False
        self._pending_input = None
        self._active_chunk = None

    def _place(self) -> str:
        """The virtual stage running now (its chunk's), for refusals."""
        chunk = self._active_chunk if self._active_chunk is not None else 0
        return stage_place(self._where().stage(self.pp_rank, chunk), self.pp_rank, self.vp_size)

    def _input_check(self, name: str):
        def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
            refuse_if_marked((args, kwargs), f"{name} (on its inputs)", self._place())

        return check

    def refuse_marked_output(self, output: Any, probing: Optional[bool] = None) -> None:
        """In the chunk's first forward: refuse a stage output computed from a stand-in's zeros.
        ``probing``: whether that forward was probed, for a caller that checks after :meth:`deactivate`
        (which ends the probe)."""
        if self.probing if probing is None else probing:
            refuse_if_marked(output, f"the user's step on the last stage (its output)", self._place())

    def next_application(self) -> int:
        """The index of the stack application starting now (reused blocks count every call)."""
        self._applications += 1
        return self._applications - 1

    def substitute_input(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The first local block's arguments with the previous stage's activation as its input
        (and what else the previous block handed over, see :mod:`.boundary_pack`)."""
        if self._pending_input is None:
            return args, kwargs
        x, self._pending_input = self._pending_input, None
        extras: list = []
        if self.router_logits is not None:
            x, *extras, logits = unpack(x, 2 + len(self.carried))
            self.router_logits.receive(logits)
        elif self.carried:
            x, *extras = unpack(x, 1 + len(self.carried))
        if args:
            args, kwargs = (x, *args[1:]), dict(kwargs)
        else:
            kwargs = {**kwargs, next(iter(kwargs)): x}
        params = self._parameter_names(block) if extras else []
        for (_, name), value in zip(self.carried, extras):
            if name not in kwargs and name in params and params.index(name) < len(args):
                args = tuple(value if i == params.index(name) else a for i, a in enumerate(args))
            else:
                kwargs[name] = value
        return args, kwargs

    def _parameter_names(self, block: nn.Module) -> list[str]:
        """The names of ``block.forward``'s parameters, looked up once per forward function."""
        forward = getattr(block.forward, "__func__", block.forward)
        names = self._forward_parameters.get(forward)
        if names is None:
            names = self._forward_parameters[forward] = list(inspect.signature(block.forward).parameters)
        return names

    def end_of_chunk(self, output: Any) -> None:
        """After the chunk's last block: end the forward with its hidden state, unless the chunk
        is the last virtual stage (then the user's forward goes on to the head and the loss)."""
        self._stack_finished = True
        if self.is_last_virtual(self._active_chunk):
            return
        values = block_outputs(output)
        if self.probing:
            refuse_if_marked(values, f"the hidden state {self.stack_path} hands the next stage", self._place())
        if not isinstance(values[0], torch.Tensor):
            raise MegatronConfigError(
                f"the blocks of {self.stack_path} return {type(output).__name__}; pipeline stages need a tensor "
                "(or a tuple whose first element is the hidden-state tensor) to send to the next stage."
            )
        if not self.carried and self.router_logits is None:
            raise StageBoundary(values[0])
        logits = [self.router_logits.send(values[0])] if self.router_logits is not None else []
        raise StageBoundary(pack([values[0]] + [values[i] for i, _ in self.carried] + logits))

    def _pre_hook(self, module, args, kwargs):
        if self._active_chunk is not None and self.on_stack_entry is not None:
            self.on_stack_entry()
        if self._active_chunk is None or self._pending_input is None:
            return None
        return self.substitute_input(module, args, kwargs)

    def _post_hook(self, module, args, output):
        if self._active_chunk is not None:
            self.end_of_chunk(output)


def _outside_swaps(anatomy: ModelAnatomy, stage: PipelineStage, first: bool, last: bool) -> list[_Swap]:
    """What a chunk that is (or is not) the first/last virtual stage runs in place of each outside
    module: the real one where the forward calls it on this chunk, a stand-in elsewhere."""
    pre_names, post_names = {o.name for o in anatomy.pre}, {o.name for o in anatomy.post}
    swaps = []
    for o in anatomy.pre + [o for o in anatomy.post if o.name not in pre_names]:
        runs_before, runs_after = o.name in pre_names, o.name in post_names
        if (first and runs_before) or (last and runs_after):
            swaps.append(_Swap(o.parent, o.attr, o.module))
        elif runs_before:
            stand_in = MetaStandIn(o.module, o.name, o.by_registration)
            stand_in.stage_done = (lambda: stage._stack_finished) if not runs_after else None
            stand_in.marking = lambda: stage.probing
            swaps.append(_Swap(o.parent, o.attr, stand_in))
        else:
            swaps.append(_Swap(o.parent, o.attr, Unreachable(o.name, o.by_registration)))
    return swaps


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
    stack_calls: Optional[tuple[int, ...]] = None,
    carried: tuple[tuple[int, str], ...] = (),
    placement: Optional[StagePlacement] = None,
    block_arity: Optional[int | tuple[str, ...]] = None,
    router_logits: Optional[RouterLogitsCarry] = None,
) -> PipelineStage:
    """Rewrite ``module`` in place into this rank's stage and return the handle that drives it.

    ``assignment`` splits the stack's blocks, or, with ``stack_calls`` (the block of each
    application, when the forward reuses blocks), the applications. ``carried``: the outputs a
    block hands the next one besides the hidden state (from the dry run), sent along with it.
    ``placement``: which stage each (rank, chunk) runs (default: the ring; ZB-V's V puts the first
    and the last stage on rank 0). ``block_arity``: how many outputs a block returns as a tuple (0:
    a bare tensor), so the placeholders of skipped blocks return the same structure; ``None``
    (unknown, no dry run): a chunk's view holds its own blocks only. ``router_logits``: carry the
    Hugging Face router logits recorded so far across each boundary (:mod:`.router_logits`).
    """
    anatomy = anatomy or ModelAnatomy.of(module, stack_path)
    chunks = assignment[pp_rank]
    stage = PipelineStage(stack_path=stack_path, chunks=chunks, pp_rank=pp_rank, pp_size=pp_size, vp_size=vp_size,
                          stack_calls=stack_calls, carried=tuple(carried), placement=placement,
                          router_logits=router_logits)
    parent_path, _, stack_attr = stack_path.rpartition(".")
    stack_parent = get_submodule_path(module, parent_path) if parent_path else module
    holds_first = any(stage.is_first_virtual(c) for c in range(vp_size))
    holds_last = any(stage.is_last_virtual(c) for c in range(vp_size))

    if stack_calls is None:
        local = LocalSequence if isinstance(stack, nn.Sequential) else LocalLayers
        all_layers = local({i: stack[i] for chunk in chunks for i in chunk})
        leading = skipped_blocks(stack, max(chunk[0] for chunk in chunks), block_arity)
        chunk_layers = [local({i: stack[i] for i in chunk}, leading[: chunk[0]]) for chunk in chunks]
        for chunk in chunks:
            stack[chunk[0]].register_forward_pre_hook(stage._pre_hook, with_kwargs=True)
            stack[chunk[-1]].register_forward_hook(stage._post_hook)
    else:
        all_layers = _reused_stack(stack, assignment, pp_rank, stack_calls, stage)
        chunk_layers = [all_layers] * len(chunks)
    for c, layers in enumerate(chunk_layers):
        swaps = [_Swap(stack_parent, stack_attr, layers)]
        stage._chunk_swaps.append(swaps + _outside_swaps(anatomy, stage, stage.is_first_virtual(c), stage.is_last_virtual(c)))
        after = [(o.name, o.module) for o in anatomy.post] if stage.is_last_virtual(c) else []
        stage._probe_targets.append([(f"{stack_path}.{i}", m) for i, m in layers.named_children()] + after)

    # At rest the rank holds its blocks and only the outside modules it runs for real; the rest
    # are dropped here, which is what frees their memory.
    stage._resting_swaps = [_Swap(stack_parent, stack_attr, all_layers)]
    stage._resting_swaps += _outside_swaps(anatomy, stage, holds_first, holds_last)
    stage.deactivate()
    # Parameters shared between a module before the stack and one after it (a tied embedding):
    # the first and last stages each keep a copy, kept equal by an all-reduce of their gradients.
    # When one rank holds both (a V placement) the two uses share the one parameter: nothing to keep equal.
    tied = list(anatomy.tied_parameters) if holds_first != holds_last else []
    stage.tied_parameters = tied + stage.shared_layer_parameters
    stand_ins = [s.module for swaps in stage._chunk_swaps + [stage._resting_swaps] for s in swaps
                 if isinstance(s.module, Unreachable)]
    stage.call_modules = _call_modules(module, stack_path, anatomy) + [(m._name, m) for m in stand_ins]
    return stage


def _call_modules(root: nn.Module, stack_path: str, anatomy: ModelAnatomy) -> list[tuple[str, nn.Module]]:
    """The stack's ancestors (the user's step reaches the stack through one of them) and the real
    modules registered after it (a step may call a head itself)."""
    parts = stack_path.split(".")
    ancestors = [(".".join(parts[:i]), get_submodule_path(root, ".".join(parts[:i])) if i else root) for i in range(len(parts))]
    return ancestors + [(o.name, o.module) for o in anatomy.post]


def _reused_stack(
    stack: nn.ModuleList, assignment: list[list[list[int]]], pp_rank: int, stack_calls: tuple[int, ...],
    stage: PipelineStage,
) -> ReusedLayers:
    """The rank's :class:`ReusedLayers`: the blocks its applications use, plus every block applied
    on more than one stage (their copies are kept equal, so every stage keeps one)."""
    users: dict[int, set[int]] = {}
    for rank, rank_chunks in enumerate(assignment):
        for application in (a for chunk in rank_chunks for a in chunk):
            users.setdefault(stack_calls[application], set()).add(rank)
    shared = sorted(b for b, ranks in users.items() if len(ranks) > 1)
    held = {b: stack[b] for b in set(shared) | {b for b, ranks in users.items() if pp_rank in ranks}}
    stage.shared_layer_parameters = [p for b in shared for p in stack[b].parameters()]
    stand_ins = {i: MetaStandIn(block, f"block {i}") for i, block in enumerate(stack)}
    for stand_in in stand_ins.values():
        stand_in.marking = lambda: stage.probing
    return ReusedLayers(held, stand_ins, stage)


def iter_microbatches(batch: Any, num_microbatches: int) -> Iterator[Any]:
    """Split every tensor of ``batch`` along dim 0 into ``num_microbatches`` equal parts, and every
    list of plain values as long as the batch (the texts beside their token ids) alike."""
    leaves, spec = flatten_batch(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if not sizes and num_microbatches == 1:
        yield batch  # the whole batch is the one microbatch: nothing to find in it
        return
    if not sizes:
        raise MegatronConfigError(
            f"pp>1 with num_microbatches={num_microbatches}: the batch ({type(batch).__name__}) holds no tensor "
            "that can be split into microbatches along dim 0 (tensors are found in dicts, lists, tuples, "
            "mappings and dataclasses; other classes, such as one a collate_fn or transfer_batch_to_device "
            "returns, are opaque). Return the batch as a dict or a dataclass of tensors, or pass num_microbatches=1.")
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
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):  # texts beside the tensors are split too
        leaves, spec = flatten_batch(batch, examples=size)
    step = size // num_microbatches
    for m in range(num_microbatches):
        yield unflatten_batch([_microbatch_of(leaf, m * step, step) for leaf in leaves], spec)


def _microbatch_of(leaf: Any, start: int, length: int) -> Any:
    """Rows ``start .. start + length`` of a tensor with a batch dimension or of per-example values;
    any other leaf whole."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
        return _own_slice(leaf, start, start + length)
    if isinstance(leaf, PerExample):
        return leaf[start : start + length]
    return leaf


def _own_slice(leaf: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``leaf[start:stop]``, the same memory, with its own version counter when it needs no gradient.

    A slice shares its base's version counter, so a model that edits its inputs in place (FSMT's
    ``shift_tokens_right`` fills the labels' -100 with padding) would bump it for every microbatch,
    and the first microbatch's backward would find the labels it saved "modified" although only
    another microbatch's rows changed. The writes still reach the user's batch, as on one device."""
    piece = leaf[start:stop]
    if piece.requires_grad or type(piece) is not torch.Tensor or piece.layout != torch.strided:
        return piece
    with torch.no_grad():
        return torch.empty(0, dtype=piece.dtype, device=piece.device).set_(
            piece.untyped_storage(), piece.storage_offset(), piece.shape, piece.stride())
