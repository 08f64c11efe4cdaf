"""``VocabParallelLogits``: vocab-sharded logits that user code can treat as full logits.

The tensor's data is this rank's LOCAL shard ``[..., padded_vocab / tp]`` of the logits;
its metadata says which global vocab ids the columns are. Through ``__torch_function__``
it behaves like the full ``[..., vocab_size]`` logits:

* ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` (class-index targets, no class weights,
  2-D or 1-D logits) run :func:`vocab_parallel_cross_entropy`: O(tokens) communication.
* ``argmax`` over the last dim is vocab-parallel (O(tokens x tp) communication).
* ``.size()``, ``.shape``, ``.numel()``, ``len()`` report the real vocab on the last dim;
  ``view``/``reshape`` that keep the last dim translate it to the local size.
* Ops that act on each vocab column independently and keep the last dim stay local and
  return ``VocabParallelLogits``: dtype/device casts, ``contiguous``, ``clone``,
  ``detach``, indexing that leaves the last dim alone, ``transpose``/``permute``/
  ``flatten``/``unsqueeze``/``squeeze`` that do not move it, and arithmetic with scalars
  (``logits / temperature``), with tensors broadcasting along the vocab (last dim 1) or
  with other logits of the same layout.
* Anything else all-gathers the full logits differentiably, strips the vocab padding, and
  runs the op on a plain tensor (warning once per op and process, since that moves
  b*s*V elements). In-place ops that cannot run locally raise instead of silently
  modifying a gathered copy.
* ``repr``/``str`` never communicate (a ``print`` on one rank only must not hang): they
  show the full shape and this rank's shard.

Every path is differentiable: gradients reaching the local shard are exact, and a plain tensor
operand of a local op that needs a gradient (a learnable temperature) gets its gradient summed over
the tensor-parallel group.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megastrategy.layers.cross_entropy import vocab_parallel_argmax, vocab_parallel_cross_entropy
from megastrategy.layers.mappings import (
    ProcessGroupRef,
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_world_size,
)

__all__ = ["VocabParallelLogits"]


@dataclass(frozen=True)
class _Meta:
    vocab_size: int
    vocab_start: int
    padded_vocab_size: int
    local_vocab: int
    group_ref: ProcessGroupRef
    rank: int
    world: int

    @property
    def group(self):
        return self.group_ref.group

    def same_layout(self, other: "_Meta") -> bool:
        return (
            self.vocab_size == other.vocab_size
            and self.vocab_start == other.vocab_start
            and self.padded_vocab_size == other.padded_vocab_size
            and self.group is other.group
        )


_warned_ops: set[str] = set()


def _reset_gather_warnings() -> None:
    """Forget which ops already warned (tests)."""
    _warned_ops.clear()


# ----------------------------------------------------------------------------------------
# op tables
# ----------------------------------------------------------------------------------------
# property getters that read the tensor's CONTENT (all others -- dtype, device,
# requires_grad, grad_fn, ndim, is_cuda... -- answer from the local tensor, no gather)
_CONTENT_GETTERS = {"T", "mT", "H", "mH", "real", "imag"}
# methods that answer from the local tensor (no gather, result returned as is)
_PASSTHROUGH_METHODS = {
    "dim", "ndimension", "is_floating_point", "is_complex", "is_contiguous", "element_size",
    "get_device", "data_ptr", "storage_offset", "untyped_storage", "storage", "is_pinned",
    "is_shared", "__hash__", "retain_grad", "register_hook",
    "register_post_accumulate_grad_hook", "is_set_to", "new_zeros", "new_ones", "new_empty",
    "new_full", "new_tensor", "is_signed", "is_inference",
}
# per-column ops that keep every dim: run on the shard, result is still logits
_LOCAL_UNARY = {
    "float", "half", "bfloat16", "double", "to", "type", "contiguous", "clone", "detach",
    "detach_", "requires_grad_", "cpu", "cuda", "pin_memory", "share_memory_",
    "neg", "negative", "__neg__", "__pos__", "positive", "abs", "exp", "tanh", "sigmoid",
    "relu", "nan_to_num", "clamp", "clip", "clamp_min", "clamp_max", "zeros_like",
    "ones_like", "empty_like", "full_like", "zero_", "fill_", "neg_", "abs_", "exp_",
    "tanh_", "sigmoid_", "relu_", "clamp_", "clip_", "nan_to_num_", "clamp_min_",
    "clamp_max_", "type_as",
}
# unary-table ops whose extra tensor arguments only provide a dtype/device
_DTYPE_SOURCES = {"to", "type_as", "type"}
# elementwise binary arithmetic; fine locally when the other operand does not vary along
# the vocab (scalar, 0-d, last dim 1) or is logits with the same layout. No ops whose
# derivative blows up at 0 (the padding columns hold zeros): no pow, no x / logits.
_LOCAL_BINARY = {
    "add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide",
    "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__", "__mul__",
    "__rmul__", "__imul__", "__truediv__", "__itruediv__", "__div__", "__idiv__",
    "add_", "sub_", "mul_", "div_", "true_divide_", "subtract_", "multiply_", "divide_",
    "rsub",
}
# binary ops where only the FIRST operand may be logits (x / t fine, t / x not)
_FIRST_ONLY = {"div", "divide", "true_divide", "__truediv__", "__itruediv__", "__div__",
               "__idiv__", "div_", "true_divide_", "divide_"}

def _func_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":
        owner = getattr(func, "__self__", None)
        return "__get__:" + (getattr(owner, "__name__", None) or "?")
    return name


def _is_inplace(name: str) -> bool:
    if name.startswith("__get__:"):
        return False
    if name.startswith("__i") and name.endswith("__") and name not in ("__init__", "__iter__",
                                                                         "__index__", "__int__",
                                                                         "__invert__"):
        return True
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))


def _map(obj, fn):
    """Apply ``fn`` to every VocabParallelLogits inside nested lists/tuples/dicts."""
    if isinstance(obj, VocabParallelLogits):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [_map(o, fn) for o in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*mapped)
        return type(obj)(mapped)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _instances(obj, kind: type, out: list) -> list:
    """Append every ``kind`` inside nested lists, tuples and dicts of ``obj`` to ``out``."""
    if isinstance(obj, kind):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _instances(o, kind, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _instances(o, kind, out)
    return out


def _to_local(x: "VocabParallelLogits") -> Tensor:
    """Plain-Tensor alias of the local shard (stays in the autograd graph)."""
    with torch._C.DisableTorchFunctionSubclass():
        return x.as_subclass(Tensor)


def _wrap(local: Tensor, meta: _Meta) -> "VocabParallelLogits":
    with torch._C.DisableTorchFunctionSubclass():
        if local.dim() == 0 or local.size(-1) != meta.local_vocab:
            raise AssertionError(
                f"internal error: local logits have shape {tuple(local.shape)}, expected the "
                f"last dim to be {meta.local_vocab}"
            )
        out = local.as_subclass(VocabParallelLogits)
    out._vp_meta = meta
    return out


def _full_shape(local_shape, meta: _Meta) -> torch.Size:
    return torch.Size((*local_shape[:-1], meta.vocab_size))


# ----------------------------------------------------------------------------------------
# the subclass
# ----------------------------------------------------------------------------------------
class VocabParallelLogits(Tensor):
    """This rank's vocab shard of the logits, behaving like the full logits (see module doc)."""

    _vp_meta: _Meta

    @classmethod
    def from_local(
        cls,
        local: Tensor,
        *,
        vocab_size: int,
        vocab_start: int,
        padded_vocab_size: int,
        group,
    ) -> "VocabParallelLogits":
        """Wrap ``local`` [..., padded_vocab_size / tp] (global ids starting at ``vocab_start``)."""
        world = group_world_size(group)
        if padded_vocab_size % world or padded_vocab_size < vocab_size:
            raise ValueError(
                f"padded_vocab_size={padded_vocab_size} must be >= vocab_size={vocab_size} and "
                f"divisible by the tensor-parallel size {world}"
            )
        meta = _Meta(
            vocab_size=int(vocab_size),
            vocab_start=int(vocab_start),
            padded_vocab_size=int(padded_vocab_size),
            local_vocab=padded_vocab_size // world,
            group_ref=ProcessGroupRef(group),
            rank=group_rank(group),
            world=world,
        )
        if isinstance(local, VocabParallelLogits):
            local = _to_local(local)
        return _wrap(local, meta)

    # -- metadata (plain Python attributes: no torch function involved) --------------------
    @property
    def vocab_size(self) -> int:
        return self._vp_meta.vocab_size

    @property
    def vocab_start(self) -> int:
        return self._vp_meta.vocab_start

    @property
    def padded_vocab_size(self) -> int:
        return self._vp_meta.padded_vocab_size

    @property
    def tp_group(self):
        return self._vp_meta.group

    @property
    def local_logits(self) -> Tensor:
        """This rank's shard as a plain tensor (differentiable alias)."""
        return _to_local(self)

    def full_logits(self) -> Tensor:
        """All-gather the full ``[..., vocab_size]`` logits (differentiable; collective)."""
        return _gather_full(self)

    # -- dispatch --------------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found: list[VocabParallelLogits] = []
        _instances(args, VocabParallelLogits, found)
        _instances(kwargs, VocabParallelLogits, found)
        if not found:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        x = found[0]
        meta = x._vp_meta
        name = _func_name(func)
        handler = _SPECIAL.get(name)
        if handler is not None:
            result = handler(func, x, meta, args, kwargs)
            if result is not NotImplemented:
                return result
        elif name.startswith("__get__:"):
            attr = name[len("__get__:"):]
            if attr == "data":
                with torch._C.DisableTorchFunctionSubclass():
                    return _wrap(func(_to_local(x)), meta)
            if attr not in _CONTENT_GETTERS:
                return _run_plain(func, args, kwargs)
        elif name in _PASSTHROUGH_METHODS or (name.startswith("_") and not name.startswith("__")):
            return _run_plain(func, args, kwargs)
        elif name in _LOCAL_UNARY:
            if _unary_is_local(name, args, kwargs, meta):
                return _run_local(func, args, kwargs, meta)
        elif name in _LOCAL_BINARY:
            if _binary_is_local(name, args, kwargs, meta):
                return _run_local(func, args, kwargs, meta)
        return _fallback(func, name, args, kwargs, x)

    def __repr__(self, *, tensor_contents=None):  # noqa: D401 - no collective here
        meta = self._vp_meta
        with torch._C.DisableTorchFunctionSubclass():
            local = _to_local(self)
            body = Tensor.__repr__(local.detach())
            full = tuple(_full_shape(local.shape, meta))
        return (
            f"VocabParallelLogits(shape={full}, vocab_size={meta.vocab_size}, local vocab ids "
            f"[{meta.vocab_start}, {meta.vocab_start + meta.local_vocab}) of padded "
            f"{meta.padded_vocab_size}, tp rank {meta.rank}/{meta.world}, local shard=\n{body})"
        )

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return self.__repr__()

    def __deepcopy__(self, memo):
        with torch._C.DisableTorchFunctionSubclass():
            local = _to_local(self).detach().clone()
        out = _wrap(local, self._vp_meta)
        with torch._C.DisableTorchFunctionSubclass():
            out.requires_grad_(self.requires_grad)
        memo[id(self)] = out
        return out


# ----------------------------------------------------------------------------------------
# execution helpers
# ----------------------------------------------------------------------------------------
def _run_plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _summed_over_tp(obj, group):
    """A plain tensor operand that needs a gradient (a learnable temperature ``logits * self.scale``, a
    per-token scale) is the same on every rank but meets only this rank's vocab columns, so its gradient
    here is a part: summed over the tensor-parallel group in backward (Megatron's copy to the region).
    Without it a learnable scale on the logits trained on half its gradient at tp2, silently."""
    if isinstance(obj, VocabParallelLogits):
        return obj
    if isinstance(obj, Tensor):
        return copy_to_tensor_parallel_region(obj, group) if obj.requires_grad and torch.is_grad_enabled() else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_summed_over_tp(o, group) for o in obj)
    if isinstance(obj, dict):
        return {k: _summed_over_tp(v, group) for k, v in obj.items()}
    return obj


def _run_local(func, args, kwargs, meta: _Meta):
    """Run ``func`` on the local shards; tensor results become logits again."""
    args, kwargs = _summed_over_tp(args, meta.group), _summed_over_tp(kwargs, meta.group)
    originals: list[VocabParallelLogits] = []
    _instances(args, VocabParallelLogits, originals)
    _instances(kwargs, VocabParallelLogits, originals)
    locals_by_id: dict[int, Tensor] = {}
    back: dict[int, VocabParallelLogits] = {}

    def unwrap(t):
        key = id(t)
        if key not in locals_by_id:
            locals_by_id[key] = _to_local(t)
            back[id(locals_by_id[key])] = t
        return locals_by_id[key]

    with torch._C.DisableTorchFunctionSubclass():
        result = func(*_map(args, unwrap), **_map(kwargs, unwrap))

    def rewrap(r):
        if not isinstance(r, Tensor):
            return r
        orig = back.get(id(r))
        if orig is not None and locals_by_id.get(id(orig)) is r:
            return orig  # in-place ops / no-op casts hand back their input
        for o in originals:
            if r is o:
                return o
        with torch._C.DisableTorchFunctionSubclass():
            if r.dim() >= 1 and r.size(-1) == meta.local_vocab:
                return _wrap(r, meta)
        return r

    if isinstance(result, (tuple, list)):
        return type(result)(rewrap(r) for r in result)
    return rewrap(result)


def _gather_full(x: VocabParallelLogits) -> Tensor:
    meta = x._vp_meta
    with torch._C.DisableTorchFunctionSubclass():
        local = _to_local(x)
        full = gather_from_tensor_parallel_region(local, meta.group)
        if full.size(-1) != meta.vocab_size:
            # contiguous like the serial logits, so that user code may .view() them
            full = full[..., : meta.vocab_size].contiguous()
    return full


def _fallback(func, name, args, kwargs, x: VocabParallelLogits):
    meta = x._vp_meta
    if _is_inplace(name):
        raise RuntimeError(
            f"in-place `{name}` on VocabParallelLogits is not supported: the logits are split "
            "over the vocab across tensor-parallel ranks, and this op cannot run on the local "
            "shard. Call `.full_logits()` first (all-gathers b*s*V) or use an out-of-place op."
        )
    if name not in _warned_ops:
        _warned_ops.add(name)
        with torch._C.DisableTorchFunctionSubclass():
            shape = tuple(_full_shape(x.shape, meta))
        warnings.warn(
            f"megastrategy: `{name}` is not vocab-parallel, so it all-gathered the full logits "
            f"{shape} ({math.prod(shape)} elements) on each of the {meta.world} tensor-parallel "
            "ranks. F.cross_entropy and argmax(dim=-1) on the logits do not gather.",
            stacklevel=3,
        )
    gathered: dict[int, Tensor] = {}

    def gather(t):
        key = id(t)
        if key not in gathered:
            gathered[key] = _gather_full(t)
        return gathered[key]

    fargs = _map(args, gather)
    fkwargs = _map(kwargs, gather)
    with torch._C.DisableTorchFunctionSubclass():
        return func(*fargs, **fkwargs)


# ----------------------------------------------------------------------------------------
# operand checks
# ----------------------------------------------------------------------------------------
def _broadcasts_along_vocab(o) -> bool:
    """Other operand that does not vary along the vocab dim."""
    if isinstance(o, (int, float, bool, complex)):
        return True
    if isinstance(o, VocabParallelLogits):
        return False
    if isinstance(o, Tensor):
        with torch._C.DisableTorchFunctionSubclass():
            return o.dim() == 0 or o.size(-1) == 1
    return False


def _unary_is_local(name, args, kwargs, meta: _Meta) -> bool:
    if "out" in kwargs:
        return False
    extra: list = []
    _instances(args[1:], Tensor, extra)
    _instances(kwargs, Tensor, extra)
    for t in extra:
        if isinstance(t, VocabParallelLogits):
            if not t._vp_meta.same_layout(meta):
                return False
        elif name not in _DTYPE_SOURCES and not _broadcasts_along_vocab(t):
            return False
    return True


def _binary_is_local(name, args, kwargs, meta: _Meta) -> bool:
    operands = list(args[:2]) + [kwargs[k] for k in ("other", "input") if k in kwargs]
    if len(operands) < 2:
        return False
    a, b = operands[0], operands[1]
    if name in _FIRST_ONLY and not isinstance(a, VocabParallelLogits):
        return False
    tensors = []
    for o in (a, b):
        if isinstance(o, VocabParallelLogits):
            if not o._vp_meta.same_layout(meta):
                return False
            tensors.append(o)
        elif not _broadcasts_along_vocab(o):
            return False
    if len(tensors) == 2:
        with torch._C.DisableTorchFunctionSubclass():
            if tensors[0].shape != tensors[1].shape:
                return False
    # alpha=... is fine; out= is not
    return "out" not in kwargs


def _norm(d: int, ndim: int) -> int:
    if not -ndim <= d < max(ndim, 1):
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {d})")
    return d % max(ndim, 1)


# ----------------------------------------------------------------------------------------
# special handlers: return NotImplemented to fall back
# ----------------------------------------------------------------------------------------
def _h_shape(func, x, meta, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return _full_shape(_to_local(x).shape, meta)


def _h_size(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        shape = _full_shape(_to_local(x).shape, meta)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        return shape
    return shape[_norm(dim, len(shape))]


def _h_numel(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        return math.prod(_full_shape(_to_local(x).shape, meta))


def _h_len(func, x, meta, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        local = _to_local(x)
        if local.dim() == 1:
            return meta.vocab_size
        return len(local)


def _shape_arg(args, kwargs):
    key = "shape" if "shape" in kwargs else "size"
    if key in kwargs:
        s = kwargs[key]
    elif len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)):
        s = args[1]
    else:
        s = args[1:]
    if isinstance(s, int):
        s = (s,)
    return tuple(s)


def _h_view_reshape(func, x, meta, args, kwargs):
    if not args or args[0] is not x:
        return NotImplemented
    if any(isinstance(a, torch.dtype) for a in args[1:]) or "dtype" in kwargs:
        return NotImplemented
    try:
        shape = tuple(int(s) for s in _shape_arg(args, kwargs))
    except (TypeError, ValueError):
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        local = _to_local(x)
        full = _full_shape(local.shape, meta)
    if not shape:
        return NotImplemented
    lead_numel = math.prod(full[:-1])
    new_lead = shape[:-1]
    if shape.count(-1) > 1:
        return NotImplemented
    if shape[-1] == meta.vocab_size:
        pass
    elif shape[-1] == -1:
        if -1 in new_lead or math.prod(new_lead) != lead_numel:
            return NotImplemented
    else:
        return NotImplemented
    if -1 not in new_lead and math.prod(new_lead) != lead_numel:
        return NotImplemented  # let torch raise the usual error on the gathered tensor
    local_shape = (*new_lead, meta.local_vocab)
    with torch._C.DisableTorchFunctionSubclass():
        method = getattr(local, func.__name__)
        return _wrap(method(local_shape), meta)


def _h_as(func, x, meta, args, kwargs):
    # view_as / reshape_as / expand_as with another logits of the same layout
    if len(args) < 2 or args[0] is not x:
        return NotImplemented
    other = args[1]
    if isinstance(other, VocabParallelLogits) and other._vp_meta.same_layout(meta):
        return _run_local(func, args, kwargs, meta)
    return NotImplemented


def _index_keeps_last_dim(index, ndim: int) -> bool:
    if not isinstance(index, tuple):
        index = (index,)

    def consumed(item) -> int | None:
        if item is None or isinstance(item, bool):
            return 0
        if isinstance(item, (int, slice)) or hasattr(item, "__index__") and not isinstance(item, Tensor):
            return 1
        if isinstance(item, VocabParallelLogits):
            return None
        if isinstance(item, Tensor):
            with torch._C.DisableTorchFunctionSubclass():
                return item.dim() if item.dtype == torch.bool else 1
        if isinstance(item, (list, range)):
            return 1
        return None

    counts = []
    for item in index:
        if item is Ellipsis:
            counts.append("...")
            continue
        c = consumed(item)
        if c is None:
            return False
        counts.append(c)
    if counts.count("...") > 1:
        return False

    def is_full(item) -> bool:
        return isinstance(item, slice) and item.start in (None, 0) and item.stop is None and item.step in (None, 1)

    if "..." in counts:
        tail = list(zip(index[counts.index("...") + 1 :], counts[counts.index("...") + 1 :]))
    else:
        total = sum(counts)
        if total > ndim:
            return False
        if total < ndim:
            return True  # the last dim is not indexed
        tail = list(zip(index, counts))
    # the last dim is addressed by the last consuming item of the tail
    for item, c in reversed(tail):
        if c == 0:
            return False  # a new axis after the last dim
        return is_full(item)
    return True  # `x[...]` or nothing after the ellipsis


def _h_getitem(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if not _index_keeps_last_dim(args[1], ndim):
        return NotImplemented
    return _run_local(func, args, kwargs, meta)


def _h_setitem(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    value = args[2]
    if _index_keeps_last_dim(args[1], ndim) and (
        _broadcasts_along_vocab(value)
        or (isinstance(value, VocabParallelLogits) and value._vp_meta.same_layout(meta))
    ):
        with torch._C.DisableTorchFunctionSubclass():
            func(*_map(args, _to_local), **kwargs)
        return None
    return NotImplemented


def _dim_arg(args, kwargs, pos: int, key: str = "dim"):
    if key in kwargs:
        return kwargs[key]
    return args[pos] if len(args) > pos else None


def _h_argmax(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    dim = _dim_arg(args, kwargs, 1)
    keepdim = _dim_arg(args, kwargs, 2, "keepdim") or False
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if dim is None or _norm(dim, ndim) != ndim - 1:
        return NotImplemented
    return vocab_parallel_argmax(
        _to_local(x), vocab_start=meta.vocab_start, vocab_size=meta.vocab_size,
        group=meta.group, keepdim=bool(keepdim),
    )


def _h_transpose(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    d0 = _dim_arg(args, kwargs, 1, "dim0")
    d1 = _dim_arg(args, kwargs, 2, "dim1")
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if not isinstance(d0, int) or not isinstance(d1, int):
        return NotImplemented
    if ndim - 1 in (_norm(d0, ndim), _norm(d1, ndim)):
        return NotImplemented
    return _run_local(func, args, kwargs, meta)


def _h_permute(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    dims = kwargs.get("dims")
    if dims is None:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if len(dims) != ndim or _norm(dims[-1], ndim) != ndim - 1:
        return NotImplemented
    return _run_local(func, args, kwargs, meta)


def _h_flatten(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    start = _dim_arg(args, kwargs, 1, "start_dim")
    end = _dim_arg(args, kwargs, 2, "end_dim")
    start = 0 if start is None else start
    end = -1 if end is None else end
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if not isinstance(start, int) or not isinstance(end, int) or ndim == 0:
        return NotImplemented
    if _norm(end, ndim) == ndim - 1 and _norm(start, ndim) != ndim - 1:
        return NotImplemented
    return _run_local(func, args, kwargs, meta)


def _h_unsqueeze(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    d = _dim_arg(args, kwargs, 1)
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if not isinstance(d, int) or _norm(d, ndim + 1) == ndim:
        return NotImplemented
    return _run_local(func, args, kwargs, meta)


def _h_squeeze(func, x, meta, args, kwargs):
    if args[0] is not x:
        return NotImplemented
    d = _dim_arg(args, kwargs, 1)
    with torch._C.DisableTorchFunctionSubclass():
        ndim = x.dim()
    if d is None:
        if meta.local_vocab == 1 and meta.vocab_size != 1:
            return NotImplemented
        return _run_local(func, args, kwargs, meta)
    dims = d if isinstance(d, (tuple, list)) else (d,)
    if not all(isinstance(i, int) for i in dims) or any(_norm(i, ndim) == ndim - 1 for i in dims):
        return NotImplemented
    return _run_local(func, args, kwargs, meta)


_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
              "reduction", "label_smoothing")
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None,
                "reduction": "mean", "label_smoothing": 0.0}


def _h_cross_entropy(func, x, meta, args, kwargs):
    if func is not F.cross_entropy:
        return NotImplemented
    bound = dict(_CE_DEFAULTS)
    bound.update(zip(_CE_PARAMS, args))
    bound.update(kwargs)
    logits, target = bound["input"], bound["target"]
    if logits is not x or isinstance(target, VocabParallelLogits) or bound["weight"] is not None:
        return NotImplemented
    if not isinstance(target, Tensor) or target.dtype.is_floating_point or target.dtype == torch.bool:
        return NotImplemented  # class probabilities
    with torch._C.DisableTorchFunctionSubclass():
        local = _to_local(x)
        if local.dim() not in (1, 2):
            return NotImplemented  # class dim 1 is not the vocab dim
        if target.dim() != local.dim() - 1 or tuple(target.shape) != tuple(local.shape[:-1]):
            return NotImplemented  # let torch produce its own error message
    reduction = bound["reduction"]
    if bound["size_average"] is not None or bound["reduce"] is not None:
        from torch.nn import _reduction

        reduction = _reduction.legacy_get_string(bound["size_average"], bound["reduce"])
    return vocab_parallel_cross_entropy(
        local, target, vocab_start=meta.vocab_start, vocab_size=meta.vocab_size,
        group=meta.group, ignore_index=bound["ignore_index"], reduction=reduction,
        label_smoothing=bound["label_smoothing"],
    )


_SPECIAL: dict[str, Callable[..., Any]] = {
    "__get__:shape": _h_shape,
    "size": _h_size,
    "numel": _h_numel,
    "nelement": _h_numel,
    "__len__": _h_len,
    "view": _h_view_reshape,
    "reshape": _h_view_reshape,
    "view_as": _h_as,
    "reshape_as": _h_as,
    "expand_as": _h_as,
    "__getitem__": _h_getitem,
    "__setitem__": _h_setitem,
    "argmax": _h_argmax,
    "transpose": _h_transpose,
    "swapaxes": _h_transpose,
    "swapdims": _h_transpose,
    "permute": _h_permute,
    "flatten": _h_flatten,
    "unsqueeze": _h_unsqueeze,
    "squeeze": _h_squeeze,
    "cross_entropy": _h_cross_entropy,
}
