"""Which modules the forward calls before and after the layer stack, found by a dry run.

Registration order is not forward order: OPT registers ``final_layer_norm`` before its
``layers``, some heads are registered before the backbone. So, once and before anything is
sharded, a parameter-free copy of the Hugging Face model on the meta device runs its own
``dummy_inputs``; hooks record, for every submodule, whether it ran before the first block,
after the last block, or both, and which block each application of the stack called (ALBERT
applies one shared block N times). Nothing real is computed and no random number is drawn.
A vision or audio model, whose ``dummy_inputs`` lack its main input, gets a random one shaped
from its config (:func:`megastrategy.layers.random_ids_forward.random_main_input`). A token-id
model outside transformers (LitGPT's ``GPT``, which registers ``lm_head`` before its blocks) is
run the same way on ids passed positionally, when its ``config`` names a vocabulary size.

The run also records the plain (non-tensor) arguments each application of the stack gets: one
that differs from the first application's (Swin's ``input_dimensions``, halved after each
downsampling stage) is computed by the forward's loop from the blocks before, which a later
pipeline stage does not run, so no stage may start there (:func:`loop_state_refusal`).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from megastrategy.anatomy import find_hf_model
from megastrategy.layers.random_ids_forward import random_main_input

__all__ = ["ForwardOrder", "MetaAttributes", "block_outputs", "dry_run_twin", "dry_run_variants", "loop_state_refusal",
           "meta_copy", "record_forward_order"]


@dataclass(frozen=True)
class ForwardOrder:
    """The dry run's findings, by dotted name from the user's module (names survive TP rewrites)."""

    called: dict[str, frozenset[str]]  # module name -> {"before"} / {"after"} / both, relative to the stack
    stack_calls: tuple[int, ...]  # the block index of each application of the stack, in order
    carried: tuple[tuple[int, str], ...] = ()  # (output index, argument name): what a block takes from the
    # previous block's outputs besides the hidden state (output 0), e.g. T5's ``position_bias``
    loop_state: tuple[tuple[int, str, Any, Any], ...] = ()  # (application, argument, its value, the
    # first application's): plain arguments the forward's loop changes from block to block
    block_arity: Optional[int | tuple[str, ...]] = None  # a block's outputs when it returns a tuple, 0 for a
    # bare tensor, the keys of a plain dict (SqueezeBERT's ``{"feature_map": ...}``); None: unseen

    @property
    def reuses_blocks(self) -> bool:
        """Whether the forward applies some block more than once (a shared layer)."""
        return len(self.stack_calls) != len(set(self.stack_calls))


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no real memory)."""
    memo: dict[int, Any] = {
        id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False) for t in module.parameters()
    }
    memo.update({id(t): torch.empty_like(t, device="meta") for t in module.buffers()})
    return copy.deepcopy(module, memo)


class MetaAttributes:
    """Mixin for a stand-in module holding ``self._meta = [meta_copy(real)]`` (a list: not a
    submodule): what the user's forward reads off the module it replaced comes from the meta copy,
    with meta tensors of the real shapes and dtypes. ViT's forward reads
    ``self.embeddings.patch_embeddings.projection.weight.dtype`` on every stage, NemotronH's loop a
    block's ``block_type``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("_meta")
            if meta is None:
                raise
            return getattr(meta[0], name)


def record_forward_order(module: nn.Module, stack_path: str) -> Optional[ForwardOrder]:
    """Dry-run the Hugging Face model holding ``stack_path``; ``None`` when there is none (or it
    cannot run on the meta device), in which case registration order is used."""
    dry = dry_run_twin(module, stack_path)
    if dry is None:
        return None
    twin, inputs, prefix, args = dry
    for variant, mode in dry_run_variants(twin, inputs):
        with mode:
            order = _run(twin, variant, prefix, stack_path[len(prefix):], args)
        if order is not None:
            return order
    return None


def dry_run_twin(module: nn.Module, stack_path: str) -> Optional[tuple[nn.Module, dict, str, tuple]]:
    """A meta copy of the model holding ``stack_path`` and what to call it with: ``(twin, keyword
    inputs, the twin's dotted prefix in module, positional inputs)``; ``None`` when there is none."""
    hf_path, hf = find_hf_model(module)
    prefix = f"{hf_path}." if hf_path else ""
    if hf is None:
        return _token_model_twin(module, stack_path)
    if not stack_path.startswith(prefix) or not hasattr(hf, "dummy_inputs"):
        return None
    try:
        twin = meta_copy(hf)
        accepted = inspect.signature(hf.forward).parameters
        inputs = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in dict(hf.dummy_inputs).items()
                  if k in accepted}  # T5EncoderModel's dummy inputs include the decoder's
        main = getattr(hf, "main_input_name", "input_ids")
        if main not in inputs and main in accepted:  # pixels, a waveform, mel features
            inputs[main] = random_main_input(main, hf.config, torch.Generator()).to("meta")
        if "decoder_input_ids" in accepted and "decoder_input_ids" not in inputs and main in inputs:
            # BART shifts labels with pad_token_id, unset on the twin; Whisper's mel features have no ids to shift
            rows = inputs[main].shape[0]
            inputs["decoder_input_ids"] = inputs.get("input_ids", torch.zeros(rows, 4, dtype=torch.long, device="meta"))
        if getattr(twin, "config", None) is not None:  # the copy's own config: no pad-token check reading values
            with contextlib.suppress(Exception):  # a strict config (NomicBERT's) wants an int: the check stays
                twin.config.pad_token_id = None
            if getattr(twin.config, "_experts_implementation", None) == "grouped_mm":  # its meta kernel wants bf16
                twin.config._experts_implementation = "batched_mm"  # MoE blocks (DeepSeek-V3, GPT-OSS) run on meta
    except Exception:  # noqa: BLE001 - an uncopyable model keeps registration order
        return None
    return twin, inputs, prefix, ()


def dry_run_variants(twin: nn.Module, inputs: dict, answer: Any = None) -> Iterator[tuple[dict, Any]]:
    """``(inputs, context)`` to try the twin with, each after the previous failed (the caller stops
    at the first that runs). SDPA's mask shortcut reads the padding mask's values (BART's decoder
    builds one), which meta tensors have not: eager attention calls the same modules in the same
    order. Eager masks still ask whether the padding mask is all ones (Canine, RoFormer build an
    all-ones mask themselves): the last try answers every such question on a meta tensor "yes",
    which picks the no-padding path the dry run's all-ones inputs would take anyway. ``answer``: a
    callable saying whether to answer now (default: always)."""
    yield inputs, contextlib.nullcontext()
    if not callable(getattr(twin, "set_attn_implementation", None)):
        return
    try:
        twin.set_attn_implementation("eager")
    except Exception:  # noqa: BLE001 - a model without eager attention keeps registration order
        return
    yield inputs, contextlib.nullcontext()
    yield inputs, _MetaTruth(answer)


class _MetaTruth(TorchFunctionMode):
    """Answers ``bool(meta tensor)`` with ``True`` (a meta tensor has no value to read)."""

    def __init__(self, answer: Any = None):
        super().__init__()
        self._answer = answer or (lambda: True)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__bool__ and args and getattr(args[0], "is_meta", False) and self._answer():
            return True
        return func(*args, **(kwargs or {}))


def _token_model(module: nn.Module, stack_path: str) -> tuple[str, Optional[nn.Module]]:
    """The innermost module holding the stack whose ``config`` names a vocabulary size (LitGPT's
    ``GPT``: ``padded_vocab_size``; nanoGPT: ``vocab_size``): a token-id model outside transformers,
    whose forward takes the ids as its first argument. ``("", None)`` when there is none."""
    parts = stack_path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:depth])
        holder = module.get_submodule(path)
        config = getattr(holder, "config", None)
        vocab = getattr(config, "padded_vocab_size", None) or getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
            return path, holder
    return "", None


def _token_model_twin(module: nn.Module, stack_path: str) -> Optional[tuple[nn.Module, dict, str, tuple]]:
    """A token-id model that is not a Hugging Face one (LitGPT registers ``lm_head`` before
    ``transformer``, so registration order would put the head on the first stage), to run on random
    ids of shape ``[2, 8]``, positionally; ``None`` when there is none or it cannot be copied."""
    path, holder = _token_model(module, stack_path)
    if holder is None:
        return None
    try:
        twin = meta_copy(holder)
    except Exception:  # noqa: BLE001 - an uncopyable model keeps registration order
        return None
    return twin, {}, f"{path}." if path else "", (torch.zeros(2, 8, dtype=torch.long, device="meta"),)


def _run(twin: nn.Module, inputs: dict, prefix: str, stack_rel: str, args: tuple = ()) -> Optional[ForwardOrder]:
    stack = twin.get_submodule(stack_rel)
    block_index = {id(b): i for i, b in enumerate(stack)}
    events: list[tuple[str, int]] = []  # (module name, number of stack applications so far)
    stack_calls: list[int] = []

    def on_call(name: str):
        def hook(mod, args):
            if id(mod) in block_index and name.startswith(stack_rel + "."):
                stack_calls.append(block_index[id(mod)])
            events.append((name, len(stack_calls)))

        return hook

    handles = [m.register_forward_pre_hook(on_call(n)) for n, m in twin.named_modules() if n]
    carried = _watch_carried(stack, handles)
    arity = _watch_arity(stack, handles)
    plain_args = _watch_plain_arguments(stack, handles)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            twin(*args, **inputs)
    except Exception:  # noqa: BLE001 - a forward that needs real data keeps registration order
        return None
    finally:
        for h in handles:
            h.remove()
    if not stack_calls:
        return None
    called: dict[str, set[str]] = {}
    for name, applied in events:
        where = "before" if applied == 0 else "after" if applied == len(stack_calls) else None
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # the module and every ancestor ran then
            if where is not None:
                called.setdefault(prefix + ".".join(parts[:depth]), set()).add(where)
    return ForwardOrder({k: frozenset(v) for k, v in called.items()}, tuple(stack_calls), tuple(sorted(carried)),
                        _loop_state(plain_args), arity[0] if arity else None)


def block_outputs(output: Any) -> list:
    """A block's outputs in order: a tuple's (or a ModelOutput's) entries, or the one tensor."""
    if isinstance(output, dict):
        return list(output.values())
    return list(output) if isinstance(output, (tuple, list)) else [output]


_PLAIN = (bool, int, float, str)


def _is_plain(value: Any) -> bool:
    """A number, a string, or a tuple/list of them (Swin's ``(height, width)``)."""
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def _named_arguments(block: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    params = list(inspect.signature(block.forward).parameters)
    named = [(params[i] if i < len(params) else f"argument {i}", a) for i, a in enumerate(args)]
    return named + list(kwargs.items())


def _watch_plain_arguments(stack: nn.ModuleList, handles: list) -> list[dict[str, Any]]:
    """Hooks that collect, per application of the stack, its plain arguments."""
    seen: list[dict[str, Any]] = []

    def before(block, args, kwargs):
        seen.append({name: value for name, value in _named_arguments(block, args, kwargs) if _is_plain(value)})

    for block in stack:
        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
    return seen


def _loop_state(plain_args: list[dict[str, Any]]) -> tuple[tuple[int, str, Any, Any], ...]:
    """The applications whose plain arguments differ from the first application's."""
    first = plain_args[0] if plain_args else {}
    return tuple((i, name, value, first[name]) for i, given in enumerate(plain_args[1:], start=1)
                 for name, value in given.items() if name in first and value != first[name])


def loop_state_refusal(order: Optional[ForwardOrder], stack_path: str, assignment: list[list[list[int]]]) -> Optional[str]:
    """Why no pipeline stage may start where ``assignment`` starts one, or ``None``: the forward
    hands the first block there a plain argument it computes from the blocks before."""
    starts = {chunk[0] for rank_chunks in assignment for chunk in rank_chunks if chunk and chunk[0] > 0}
    for application, name, value, first in order.loop_state if order is not None else ():
        if application in starts:
            return (
                f"a pipeline stage would start at block {application} of {stack_path}, and the forward hands that "
                f"block {name}={value!r} where it hands block 0 {name}={first!r}: it computes {name} in its loop from "
                "the blocks before (a hierarchical model such as Swin, whose stages downsample), which that stage "
                "does not run, so it would get the wrong value. Use pp=1 for this model."
            )
    return None


def _watch_arity(stack: nn.ModuleList, handles: list) -> list[int | tuple[str, ...]]:
    """A hook that records how many outputs the first block call returns as a tuple (0 for a bare
    tensor or anything else; a plain dict's keys), so placeholders of skipped blocks return the same."""
    seen: list[int | tuple[str, ...]] = []

    def after(block, args, output):
        if not seen:
            seen.append(len(output) if isinstance(output, tuple) else tuple(output) if type(output) is dict else 0)

    for block in stack:
        handles.append(block.register_forward_hook(after))
    return seen


def _watch_carried(stack: nn.ModuleList, handles: list) -> set[tuple[int, str]]:
    """Hooks that collect which of a block's outputs besides the hidden state the next block takes,
    and as which argument (T5's ``position_bias``): the stage boundary must carry them."""
    extra_outputs: dict[int, int] = {}  # id of an output tensor -> its index among the outputs
    carried: set[tuple[int, str]] = set()

    def before(block, args, kwargs):
        named = _named_arguments(block, args, kwargs)
        carried.update((extra_outputs[id(v)], name) for name, v in named if isinstance(v, torch.Tensor) and id(v) in extra_outputs)

    def after(block, args, output):
        extra_outputs.clear()
        values = block_outputs(output)
        extra_outputs.update((id(v), i) for i, v in enumerate(values) if i > 0 and isinstance(v, torch.Tensor))

    for block in stack:
        handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(block.register_forward_hook(after))
    return carried
