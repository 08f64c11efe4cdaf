"""Activation recomputation (activation checkpointing) on an unchanged module.

``apply_activation_checkpointing(module, mode, rng_tracker=...)`` makes parts of the
model keep only their inputs during the forward and recompute the rest in backward, with
:func:`megastrategy.layers.random.checkpoint` semantics: the default random stream and the
model-parallel stream of the :class:`~megastrategy.layers.random.ModelParallelRNGTracker`
are replayed, so dropout masks (replicated and per-TP-rank) are the same in the recompute
and losses and gradients are bitwise those of the run without recomputation.

Modes
-----
``"full"``
    every block of the layer stack (the ``nn.ModuleList`` the pipeline splits, found by
    :func:`megastrategy.pipeline.stage.find_layer_stack`) runs under the checkpoint; only
    its inputs are kept.
``"selective"``
    only the attention core is recomputed (the part whose activations grow with the
    square of the sequence length):

    * Hugging Face attention modules that dispatch through ``ALL_ATTENTION_FUNCTIONS``
      (``BertSelfAttention``, ``GPT2Attention``, ``LlamaAttention`` and relatives): only
      the attention function (scores, softmax, dropout, weighted sum) is recomputed; the
      projections keep their activations. The module's ``config`` is replaced by a
      read-through view whose ``_attn_implementation`` names a registered wrapper that
      calls the model's own implementation under the checkpoint; the shared config object
      is not modified.
    * ``nn.MultiheadAttention`` and its tensor-parallel replacement: the whole module.
    * user blocks: every module whose class name contains ``"Attention"`` (the outermost
      one when they nest), or the modules named by ``selective_modules`` (globs over the
      names inside a block, e.g. ``["attn", "mlp.act"]``). A block stack in which nothing
      is found is an error: use ``"full"`` or name the modules.
``None``
    nothing of ours, but Hugging Face ``model.gradient_checkpointing_enable()`` is honoured
    (see below).

How modules are wrapped
-----------------------
The module's ``forward`` is replaced by an instance attribute that calls the class's
``forward`` under the checkpoint. ``Module.__call__`` still runs the module's hooks
*outside* the checkpoint, so the pipeline stage's hooks (a forward pre-hook substituting
the first block's input, a forward hook ending the stage with a ``BaseException``) and the
sequence-parallel hooks behave as without recomputation. Parameter names, ``state_dict``
keys and module types are unchanged; ``copy.deepcopy`` of the module works (the copy
recomputes its own forward). Under ``torch.no_grad`` (evaluation) nothing is checkpointed.

Context parallelism
-------------------
With ``cp > 1`` every checkpoint started inside a split forward (these, Hugging Face's, the user's
own) replays in backward inside the same split microbatch: ring attention, global positions, token
losses (:mod:`megastrategy.context.recompute`). Nothing here depends on it.

Hugging Face gradient checkpointing
-----------------------------------
A Hugging Face model on which the user called ``gradient_checkpointing_enable()`` would
checkpoint ``Module.__call__`` (hooks inside the checkpoint) with torch's checkpoint (only
the default stream replayed). For blocks of the layer stack, its flag is turned off and
the block is wrapped as in ``"full"`` mode (also when ``mode`` is ``None``); other
Hugging Face checkpointing layers keep their flag but use this module's checkpoint.
"""
from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.random import ModelParallelRNGTracker
from megastrategy.layers.random import checkpoint as _mp_checkpoint

__all__ = [
    "RECOMPUTE_MODES",
    "apply_activation_checkpointing",
    "checkpoint_call",
    "is_checkpointed",
    "validate_recompute_mode",
]

RECOMPUTE_MODES = ("full", "selective")
HF_RECOMPUTE_ATTENTION = "megastrategy_recompute"


def validate_recompute_mode(mode: Optional[str]) -> None:
    """Raise :class:`MegatronConfigError` for an unknown ``activation_checkpointing`` value."""
    if mode is not None and mode not in RECOMPUTE_MODES:
        raise MegatronConfigError(
            f"activation_checkpointing={mode!r}: use 'full' (recompute every transformer block), 'selective' "
            "(recompute only the attention core) or None."
        )


# ----------------------------------------------------------------------------------------
# the checkpoint call
# ----------------------------------------------------------------------------------------
class _ForkedReplay:
    """Recompute context for a function first run *inside* ``tracker.fork()``: re-enter the
    fork with the tracker stream as it was then, and put the live stream back afterwards."""

    def __init__(self, tracker: ModelParallelRNGTracker, state: Tensor) -> None:
        self.tracker, self.state = tracker, state
        self._stack: list[tuple[Optional[Tensor], Any]] = []

    def __enter__(self) -> None:
        t = self.tracker
        live = t._current_state().clone() if t.is_initialized else None
        t._install_state(self.state.clone())
        fork = t.fork()
        fork.__enter__()
        self._stack.append((live, fork))

    def __exit__(self, *exc: Any) -> None:
        live, fork = self._stack.pop()
        fork.__exit__(None, None, None)
        if live is not None:
            self.tracker._install_state(live)
        return None


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def checkpoint_call(
    function: Callable[..., Any], *args: Any, rng_tracker: Optional[ModelParallelRNGTracker] = None, **kwargs: Any
) -> Any:
    """``function(*args, **kwargs)`` under a non-reentrant activation checkpoint replaying
    the default stream and, when given, ``rng_tracker``'s stream.

    Works outside ``rng_tracker.fork()`` (the usual case: the function forks where it needs
    to) and inside it (e.g. an attention core called in a per-TP-rank RNG region): the
    recompute then runs inside the fork again, from the stream state of the original call.
    """
    if rng_tracker is None:
        return _torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    if not rng_tracker.is_forked:
        return _mp_checkpoint(function, *args, rng_tracker=rng_tracker, **kwargs)
    state = rng_tracker._current_state().clone()

    def context_fn():
        return _nothing(), _ForkedReplay(rng_tracker, state)

    return _torch_checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **kwargs
    )


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _checkpoint_arguments(
    function: Callable[..., Any], args: tuple, kwargs: dict, rng_tracker: Optional[ModelParallelRNGTracker]
) -> Any:
    """:func:`checkpoint_call` that keeps tensor identity: each distinct tensor argument
    (positional or keyword) is handed to the checkpoint once and put back in every place
    it was passed, so code testing ``query is key`` behaves the same in the recompute."""
    tensors: list[Tensor] = []
    where: dict[int, int] = {}

    def slot(v: Any) -> Any:
        if not isinstance(v, Tensor):
            return v
        i = where.get(id(v))
        if i is None:
            i = where[id(v)] = len(tensors)
            tensors.append(v)
        return _Slot(i)

    a_spec = [slot(a) for a in args]
    k_spec = {k: slot(v) for k, v in kwargs.items()}

    def run(*ts: Tensor) -> Any:
        a = [ts[v.index] if isinstance(v, _Slot) else v for v in a_spec]
        k = {n: (ts[v.index] if isinstance(v, _Slot) else v) for n, v in k_spec.items()}
        return function(*a, **k)

    return checkpoint_call(run, *tensors, rng_tracker=rng_tracker)


class _CheckpointedForward:
    """Instance-level ``forward`` of a wrapped module: the class's forward under the checkpoint.

    Holds the module itself (not a bound method), so ``copy.deepcopy`` of the module gives a
    copy whose wrapper calls the copy.
    """

    def __init__(self, module: nn.Module, inner: Optional[Callable], rng_tracker: Optional[ModelParallelRNGTracker]):
        self.module = module
        self.inner = inner  # a forward that was already set on the instance, if any
        self.rng_tracker = rng_tracker

    def _forward(self) -> Callable:
        if self.inner is not None:
            return self.inner
        return type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._forward()
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return _checkpoint_arguments(fn, args, kwargs, self.rng_tracker)

    def __repr__(self) -> str:
        return f"<checkpointed forward of {type(self.module).__name__}>"


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward (or its Hugging Face attention core) is recomputed."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward) or isinstance(
        getattr(module, "config", None), _RecomputeAttentionConfig
    )


def _wrap_forward(module: nn.Module, rng_tracker: Optional[ModelParallelRNGTracker]) -> bool:
    current = module.__dict__.get("forward")
    if isinstance(current, _CheckpointedForward):
        return False
    module.forward = _CheckpointedForward(module, current, rng_tracker)
    return True


# ----------------------------------------------------------------------------------------
# Hugging Face attention core
# ----------------------------------------------------------------------------------------
class _RecomputeAttentionConfig:
    """Read-through view of a Hugging Face config whose ``_attn_implementation`` names the
    recompute wrapper; everything else (also later changes) comes from the real config."""

    def __init__(self, config: Any, rng_tracker: Optional[ModelParallelRNGTracker]) -> None:
        object.__setattr__(self, "_megastrategy_config", config)
        object.__setattr__(self, "_megastrategy_tracker", rng_tracker)

    @property
    def _attn_implementation(self) -> str:
        return HF_RECOMPUTE_ATTENTION

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith("_megastrategy_"):
            raise AttributeError(name)
        return getattr(self._megastrategy_config, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._megastrategy_config, name, value)

    def __repr__(self) -> str:
        return f"RecomputeAttentionConfig({type(self._megastrategy_config).__name__})"


def _inner_attention(module: nn.Module) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(module.config._megastrategy_config, "_attn_implementation", None)
    if impl in (None, "eager"):
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"no eager_attention_forward next to {type(module).__name__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)


def _recompute_attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The registered attention function: the model's own one, under the checkpoint."""
    fn = _inner_attention(module)
    tracker = module.config._megastrategy_tracker
    if not torch.is_grad_enabled():
        return fn(module, *args, **kwargs)
    return _checkpoint_arguments(fn, (module, *args), kwargs, tracker)


def _register_hf_attention() -> bool:
    try:
        from transformers.modeling_utils import AttentionInterface
    except Exception:  # noqa: BLE001 - transformers missing or too old
        return False
    AttentionInterface.register(HF_RECOMPUTE_ATTENTION, _recompute_attention)
    return True


def _hf_core_capable(m: nn.Module) -> bool:
    """Attention modules whose forward dispatches ``self.config._attn_implementation``."""
    config = getattr(m, "config", None)
    if isinstance(config, _RecomputeAttentionConfig):
        return True  # already wrapped
    if config is None or "Attention" not in type(m).__name__:
        return False
    if not hasattr(config, "_attn_implementation"):
        return False
    source = sys.modules.get(type(m).__module__)
    if source is None or not hasattr(source, "ALL_ATTENTION_FUNCTIONS") or not hasattr(source, "eager_attention_forward"):
        return False
    if getattr(m, "reorder_and_upcast_attn", False):
        return False  # GPT-2's eager special path compares the name with "eager"
    return True


def _wrap_hf_core(m: nn.Module, rng_tracker: Optional[ModelParallelRNGTracker]) -> bool:
    if isinstance(getattr(m, "config", None), _RecomputeAttentionConfig):
        return False
    if not _register_hf_attention():
        return False
    m.config = _RecomputeAttentionConfig(m.config, rng_tracker)
    return True


# ----------------------------------------------------------------------------------------
# Hugging Face gradient_checkpointing_enable()
# ----------------------------------------------------------------------------------------
def _hf_checkpointing_layers(module: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in module.modules()
        if getattr(m, "gradient_checkpointing", False) is True and hasattr(m, "_gradient_checkpointing_func")
    ]


def _adopt_hf_checkpointing(
    module: nn.Module, blocks: Sequence[nn.Module], rng_tracker: Optional[ModelParallelRNGTracker]
) -> list[nn.Module]:
    """Turn HF's own checkpointing off on the stack's blocks (returns those where it was on)
    and point the remaining HF checkpointing modules at :func:`checkpoint_call`."""
    in_stack = {id(b) for b in blocks}
    adopted = []
    for m in _hf_checkpointing_layers(module):
        if id(m) in in_stack:
            m.gradient_checkpointing = False
            adopted.append(m)
        else:
            m._gradient_checkpointing_func = functools.partial(checkpoint_call, rng_tracker=rng_tracker)
    return adopted


# ----------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------
def _selective_targets(block: nn.Module, globs: Optional[Sequence[str]]) -> list[tuple[str, nn.Module, str]]:
    """(name in block, module, how) with how in {"core", "forward"}."""
    named = [(n, m) for n, m in block.named_modules() if n]
    if globs:
        picked = [(n, m) for n, m in named if any(fnmatchcase(n, g) for g in globs)]
        picked = [(n, m) for n, m in picked if not any(n.startswith(o + ".") for o, _ in picked if o != n)]
        return [(n, m, "forward") for n, m in picked]
    from megastrategy.layers.attention import TensorParallelMultiheadAttention

    chosen: list[tuple[str, nn.Module, str]] = []
    for n, m in named:
        if _hf_core_capable(m):
            chosen.append((n, m, "core"))
        elif isinstance(m, (nn.MultiheadAttention, TensorParallelMultiheadAttention)):
            chosen.append((n, m, "forward"))

    def related(n: str) -> bool:
        return any(n == c or n.startswith(c + ".") or c.startswith(n + ".") for c, _, _ in chosen)

    attention = [(n, m) for n, m in named if "Attention" in type(m).__name__]
    for n, m in attention:
        if related(n) or any(n.startswith(o + ".") for o, _ in attention):
            continue  # covered by a chosen module, or an outer attention module is taken instead
        chosen.append((n, m, "forward"))
    return chosen


def apply_activation_checkpointing(
    module: nn.Module,
    mode: Optional[str],
    *,
    rng_tracker: Optional[ModelParallelRNGTracker],
    pipeline_layers: Optional[str] = None,
    selective_modules: Optional[Sequence[str]] = None,
) -> list[str]:
    """Recompute activations of ``module``'s layer stack in backward (see the module docs).

    Call after :func:`~megastrategy.layers.plan.apply_tp_plan` (and after
    :func:`~megastrategy.layers.sequence_parallel.enable_sequence_parallel`); before or
    after the pipeline cut (hooks are never inside the checkpoint). ``rng_tracker`` is the
    strategy's tracker (``None`` replays only the default stream). Idempotent.

    Returns the names (in ``module``) of the modules now recomputed.
    """
    from megastrategy.pipeline.stage import find_layer_stack

    validate_recompute_mode(mode)
    if selective_modules is not None and mode != "selective":
        raise MegatronConfigError("selective_modules=... is only used with activation_checkpointing='selective'.")
    hf_layers = _hf_checkpointing_layers(module)
    if mode is None and not hf_layers:
        return []
    path, stack = find_layer_stack(module, pipeline_layers)
    blocks = list(stack)
    names = {id(m): n for n, m in module.named_modules()}
    done: list[str] = []
    adopted = _adopt_hf_checkpointing(module, blocks, rng_tracker)
    if mode is None:
        for b in adopted:  # HF's every_n_layers: only the blocks it had switched on
            _wrap_forward(b, rng_tracker)
            done.append(names.get(id(b), path))
    elif mode == "full":
        for b in blocks:
            if _wrap_forward(b, rng_tracker) or is_checkpointed(b):
                done.append(names.get(id(b), path))
    elif mode == "selective":
        for b in blocks:
            for _, m, how in _selective_targets(b, selective_modules):
                ok = _wrap_hf_core(m, rng_tracker) if how == "core" else _wrap_forward(m, rng_tracker)
                if ok or is_checkpointed(m):
                    done.append(names.get(id(m), "?"))
        if not done:
            what = f"modules matching {list(selective_modules)}" if selective_modules else "attention module"
            raise MegatronConfigError(
                f"activation_checkpointing='selective' found no {what} in the blocks of {path} "
                f"({type(blocks[0]).__name__}): it recomputes modules whose class name contains 'Attention' "
                "(and nn.MultiheadAttention / Hugging Face attention cores). Use activation_checkpointing='full', "
                "or name the modules to recompute (selective_modules=['attn', ...], names inside a block)."
            )
    return done
