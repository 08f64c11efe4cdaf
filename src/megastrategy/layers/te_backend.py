"""Optional Transformer Engine (TE) backend for the tensor-parallel linear layers.

Transformer Engine (``transformer_engine.pytorch``) runs the GEMMs of a linear layer with
fused CUDA kernels and, under :func:`megastrategy.layers.fp8.fp8_autocast`, in FP8. It only
exists for CUDA (there is no CPU build), so it is an optional backend:

* :func:`resolve_backend` turns the user's ``backend`` (``"auto"``, ``"torch"``, ``"te"``)
  into the one used on this device, and says what to do when ``"te"`` cannot work;
* :func:`convert_to_te` runs **after** the torch tensor-parallel plan was applied (and after
  :func:`~megastrategy.layers.sequence_parallel.enable_sequence_parallel`, if used) and
  replaces each :class:`~megastrategy.layers.linear.ColumnParallelLinear` /
  :class:`~megastrategy.layers.linear.RowParallelLinear` by a ``te.pytorch.Linear`` that
  computes exactly the same thing, or leaves it alone and says why.

Why convert after the torch plan instead of building TE layers directly: the torch plan is
where every decision about *what* is sharded and *how* lives (auto-detection, packed QKV,
head fix-ups, ties, sequence-parallel layouts, hooks); converting afterwards reuses all of it
and only swaps the GEMM implementation, layer by layer, with the same local shard.

What "exactly the same" means
-----------------------------
The TE layer holds the same local shard values (copied, never re-initialized), keeps the
parameter names (``weight``, ``bias``), the shard metadata
(:data:`~megastrategy.layers.shard_spec.SHARD_ATTR`) and every other public attribute of the
parameters (e.g. the ``sequence_parallel`` gradient tag), ``requires_grad``, the train/eval
mode and the forward hooks of the torch layer; and it performs the same communication:

==========================================  ==================================================
torch layer                                 TE layer
==========================================  ==================================================
column, own input copy (no ``input_copy``)  ``Linear(parallel_mode="column")``: TE does the
                                            identity / backward all-reduce itself
column, sequence parallel on dim 0          ``Linear(parallel_mode="column",
                                            sequence_parallel=True)``: TE all-gathers dim 0
column with a shared ``input_copy``         ``Linear(parallel_mode=None)`` on the local shard
(q/k/v fed one tensor), or sequence         (a GEMM without communication) and the torch
parallel on another dim                     layer's own input communication, verbatim, in a
                                            forward pre-hook: the one shared all-reduce /
                                            all-gather is kept (TE's column mode would
                                            all-reduce each layer's input gradient apart)
row, input already split                    ``Linear(parallel_mode="row")``: all-reduce (or
(``input_is_parallel=True``)                reduce-scatter of dim 0 under sequence parallel),
                                            bias added after the reduction
==========================================  ==================================================

Left on the torch layer (listed with the reason in the :class:`TEConversionReport`):
``gather_output=True`` (TE returns only the local shard), ``skip_bias_add=True`` (TE's
``return_bias`` hands back the bias cast to the activation dtype, and an empty tensor instead
of ``None`` without bias), a row layer with ``input_is_parallel=False`` (TE does not split the
input), a row layer under sequence parallelism on a dimension other than 0 (TE reduce-scatters
the first dimension only), subclasses of the torch layers (their forward may differ),
parameters of a dtype TE does not compute in, parameters shared with another module, and
layers with backward or state-dict hooks.

Packed projections (fused QKV, ``packed_chunks > 1``) convert: the local rows
``[q_r | k_r | v_r]`` are an ordinary local shard for TE; only gathering them (which is
refused anyway) needs the packing.

Layer-norm fusion (``te.pytorch.LayerNormLinear``) is not done: which layer consumes a norm's
output is decided by the user's ``forward``, not visible in the module structure, and the
fused layer would own the norm's parameters under new names (``layer_norm_weight``), so the
checkpoint would stop matching the user's ``state_dict``.

Under ``torch.autocast`` both a converted row layer and :class:`RowParallelLinear` return the
autocast dtype, as the user's ``nn.Linear`` does.

Two things outside this module see a converted model differently:

* ``state_dict()`` gains one ``<layer>._extra_state`` entry per TE layer (TE's serialized FP8
  scaling state, a uint8 tensor whose size changes once FP8 ran); it is not a tensor of the
  user's model, so the sharded checkpoint must leave it out (or store it per rank);
* TE recommends its own ``te.distributed.checkpoint`` for activation recompute under FP8 (so
  the recomputed forward does not update the FP8 statistics a second time).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear
from megastrategy.layers.mappings import (
    ProcessGroupRef,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    group_world_size,
)
from megastrategy.naming import join_name

__all__ = [
    "BACKENDS",
    "TE_INSTALL_HINT",
    "probe_transformer_engine",
    "resolve_backend",
    "import_transformer_engine",
    "ConvertedLayer",
    "KeptLayer",
    "TEConversionReport",
    "convert_to_te",
    "TorchColumnInput",
]

BACKENDS = ("auto", "torch", "te")
TE_INSTALL_HINT = "pip install --no-build-isolation transformer_engine[pytorch]"
#: parameter dtypes TE's GEMMs take (FP8 is a compute mode under autocast, not a parameter dtype)
_TE_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Probe = Callable[[], "tuple[bool, str]"]


# ----------------------------------------------------------------------------------------
# backend resolution
# ----------------------------------------------------------------------------------------
def probe_transformer_engine() -> tuple[bool, str]:
    """``(True, "")`` when ``transformer_engine.pytorch`` imports, else ``(False, why)``.

    Any exception counts as "not available": besides ``ImportError``, a TE build whose CUDA
    libraries do not match raises ``OSError``/``RuntimeError`` on import.
    """
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # noqa: BLE001 - see docstring
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def _as_device(device: Any) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError:
            pass
    raise MegatronConfigError(
        f"device={device!r}: must be a torch.device or a device string such as 'cuda:0' or 'cpu' "
        "(the device the model trains on)."
    )


def resolve_backend(backend: str, device: Any, *, probe: Optional[Probe] = None) -> str:
    """The linear-layer backend to use on ``device``: ``"torch"`` or ``"te"``.

    ``backend="auto"`` picks ``"te"`` when ``transformer_engine.pytorch`` imports and
    ``device`` is a CUDA device, else ``"torch"``. ``backend="te"`` where that does not hold
    raises :class:`MegatronConfigError` saying which condition failed and what works.
    ``probe`` (default :func:`probe_transformer_engine`) answers "does TE import?"; tests
    inject one.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise MegatronConfigError(
            f"backend={backend!r}: must be one of {', '.join(repr(b) for b in BACKENDS)} ('auto' uses "
            "Transformer Engine where it imports and the device is CUDA, 'torch' the built-in layers, "
            "'te' requires Transformer Engine)."
        )
    if backend == "torch":
        return "torch"
    dev = _as_device(device)
    available, why = (probe or probe_transformer_engine)()
    if backend == "auto":
        return "te" if available and dev.type == "cuda" else "torch"
    problems = []
    if not available:
        problems.append(f"transformer_engine.pytorch does not import ({why})")
    if dev.type != "cuda":
        problems.append(f"the device is {dev} and Transformer Engine's layers run only on CUDA GPUs")
    if problems:
        raise MegatronConfigError(
            f"backend='te': {'; and '.join(problems)}. Use a CUDA machine with Transformer Engine installed "
            f"(`{TE_INSTALL_HINT}`), or backend='torch' (or 'auto', which uses TE only where it works)."
        )
    return "te"


def import_transformer_engine():
    """``transformer_engine.pytorch``, or :class:`MegatronConfigError` saying how to get it."""
    ok, why = probe_transformer_engine()
    if not ok:
        raise MegatronConfigError(
            f"the Transformer Engine backend needs transformer_engine.pytorch, which does not import ({why}); "
            f"install it on a CUDA machine (`{TE_INSTALL_HINT}`) or use backend='torch'."
        )
    return importlib.import_module("transformer_engine.pytorch")


# ----------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConvertedLayer:
    """A torch layer replaced by ``te.pytorch.<te_type>``.

    ``parallel_mode``: the TE ``parallel_mode`` (``"column"``, ``"row"``, or ``None`` for a
    GEMM on the local shard whose input communication stays the torch layer's own);
    ``detail``: how the communication is done and anything that differs.
    """

    name: str
    torch_type: str
    te_type: str
    parallel_mode: Optional[str]
    sequence_parallel: bool
    detail: str


@dataclass(frozen=True)
class KeptLayer:
    """A tensor-parallel torch layer left as it is, and why TE cannot replace it exactly."""

    name: str
    torch_type: str
    reason: str


@dataclass
class TEConversionReport:
    """What :func:`convert_to_te` did; print it (``str(report)``) for logs."""

    tp_size: int
    converted: list[ConvertedLayer] = field(default_factory=list)
    kept: list[KeptLayer] = field(default_factory=list)
    layernorm_fusion: str = ""

    @property
    def converted_names(self) -> list[str]:
        return [c.name for c in self.converted]

    @property
    def kept_names(self) -> list[str]:
        return [k.name for k in self.kept]

    def __getitem__(self, name: str):
        for entry in (*self.converted, *self.kept):
            if entry.name == name:
                return entry
        raise KeyError(name)

    def table(self) -> str:
        lines = [
            f"Transformer Engine conversion: tp={self.tp_size}, {len(self.converted)} layer(s) converted, "
            f"{len(self.kept)} kept on torch"
        ]
        for c in self.converted:
            mode = "local GEMM" if c.parallel_mode is None else c.parallel_mode
            sp = ", sequence parallel" if c.sequence_parallel else ""
            lines.append(f"  {c.name or '<root>'}: {c.torch_type} -> te.{c.te_type} ({mode}{sp}); {c.detail}")
        for k in self.kept:
            lines.append(f"  {k.name or '<root>'}: {k.torch_type} kept: {k.reason}")
        if self.layernorm_fusion:
            lines.append(f"  layer-norm fusion: {self.layernorm_fusion}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ----------------------------------------------------------------------------------------
# conversion
# ----------------------------------------------------------------------------------------
_NO_FUSION = (
    "not done: which layer consumes a norm's output is decided by the user's forward, and the fused "
    "te.pytorch.LayerNormLinear would own the norm's parameters under new names, breaking checkpoints"
)

#: forward-hook dictionaries of nn.Module that move to the TE layer together (ids are global)
_FORWARD_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_OTHER_HOOK_DICTS = (
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class TorchColumnInput:
    """Forward pre-hook of a TE layer built with ``parallel_mode=None``: the input
    communication of the :class:`ColumnParallelLinear` it replaced, unchanged (its shared
    ``input_copy`` object, or the sequence all-gather along ``sequence_dim``, or the
    identity / backward all-reduce)."""

    def __init__(self, group, input_copy, sequence_parallel: bool, sequence_dim: int):
        self._group_ref = ProcessGroupRef(group)
        self.input_copy = input_copy
        self.sequence_parallel = bool(sequence_parallel)
        self.sequence_dim = int(sequence_dim)

    def __call__(self, module: nn.Module, args: tuple):
        if not args:
            return None
        x, group = args[0], self._group_ref.group
        if self.input_copy is not None:
            x = self.input_copy(x)
        elif self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, group, self.sequence_dim)
        else:
            x = copy_to_tensor_parallel_region(x, group)
        return (x, *args[1:])

    def __repr__(self) -> str:
        return (f"TorchColumnInput(input_copy={self.input_copy!r}, sequence_parallel={self.sequence_parallel}, "
                f"sequence_dim={self.sequence_dim})")


def _decide(m: nn.Module, holders: dict[int, list[str]], paths: set[str]) -> tuple[str, str]:
    """``(mode, text)``: mode ``keep`` (text = reason) or ``column``/``local``/``row``
    (text = detail for the report)."""
    cls = type(m)
    if cls not in (ColumnParallelLinear, RowParallelLinear):
        base = "ColumnParallelLinear" if isinstance(m, ColumnParallelLinear) else "RowParallelLinear"
        return "keep", f"a subclass of {base} ({cls.__name__}); its forward may differ from what TE computes"
    for pname, p in m.named_parameters(recurse=False):
        others = [h for h in holders.get(id(p), []) if h.rpartition(".")[0] not in paths]
        if others:
            return "keep", f"{pname} is shared with {', '.join(others)}; the TE layer would own a separate copy"
        if p.dtype not in _TE_PARAM_DTYPES:
            return "keep", f"{pname} is {p.dtype}; TE computes with float32/bfloat16/float16 parameters"
    for attr in _OTHER_HOOK_DICTS:
        if getattr(m, attr, None):
            return "keep", f"it has {attr.strip('_').replace('_', ' ')} registered, which cannot move to the TE layer"
    if m.skip_bias_add:
        return "keep", (
            "skip_bias_add=True: TE's return_bias hands the bias back cast to the activation dtype "
            "(and an empty tensor instead of None without bias), so the caller's addition could change"
        )
    if cls is ColumnParallelLinear:
        if m.gather_output:
            return "keep", "gather_output=True: TE's column mode returns only this rank's output shard"
        packed = f"; packed_chunks={m.packed_chunks}: the local rows stay [c0_r|c1_r|...]" if m.packed_chunks > 1 else ""
        if m.input_copy is not None:
            return "local", (f"input communication shared with sibling layers ({type(m.input_copy).__name__}) "
                             f"kept in a pre-hook" + packed)
        if m.sequence_parallel and m.sequence_dim != 0:
            return "local", (f"sequence all-gather along dim {m.sequence_dim} kept in a pre-hook (TE gathers "
                             "dim 0 only)" + packed)
        if m.sequence_parallel:
            return "column", "TE all-gathers the sequence (dim 0) in forward, reduce-scatters in backward" + packed
        return "column", "TE does the backward all-reduce of the input gradient" + packed
    if not m.input_is_parallel:
        return "keep", "input_is_parallel=False: the input must be split over TP first, which TE's row mode does not do"
    if m.sequence_parallel and m.sequence_dim != 0:
        return "keep", (f"sequence parallel along dim {m.sequence_dim}: TE's row mode reduce-scatters the first "
                        "dimension only")
    how = "TE reduce-scatters dim 0" if m.sequence_parallel else "TE all-reduces the output"
    return "row", f"{how}, then adds the bias"


def _check_param_state(name: str, p: torch.Tensor) -> None:
    if hasattr(p, "main_grad") or getattr(p, "_post_accumulate_grad_hooks", None) or getattr(p, "_backward_hooks", None):
        raise MegatronConfigError(
            f"convert_to_te: parameter {name} already has gradient hooks or a main_grad (the gradient buffer "
            "was built); call convert_to_te before the gradient buffer and the optimizers are created, since "
            "it replaces the parameters."
        )


def _build(te, m: nn.Module, mode: str, tp_group, tp_size: int) -> nn.Module:
    common = dict(bias=m.bias is not None, params_dtype=m.weight.dtype, device=m.weight.device)
    if mode == "local":
        return te.Linear(m.in_features, m.output_size_per_partition, tp_group=None, tp_size=1,
                         parallel_mode=None, sequence_parallel=False, **common)
    # TE takes the GLOBAL sizes and allocates the local shard itself
    return te.Linear(m.in_features, m.out_features, tp_group=tp_group, tp_size=tp_size, parallel_mode=mode,
                     sequence_parallel=bool(m.sequence_parallel), **common)


def _carry_parameter(name: str, old: torch.Tensor, new: torch.Tensor) -> None:
    if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
        raise RuntimeError(
            f"convert_to_te: the TE layer for {name} allocated {tuple(new.shape)} {new.dtype} but the torch "
            f"layer holds {tuple(old.shape)} {old.dtype}; the installed Transformer Engine does not follow the "
            "Linear(in_features, out_features, parallel_mode=...) contract this conversion relies on."
        )
    with torch.no_grad():
        new.copy_(old)
    new.requires_grad_(old.requires_grad)
    if old.grad is not None:
        new.grad = old.grad.detach().clone()
    # shard metadata and gradient tags (``megastrategy_shard``, ``sequence_parallel``, ...)
    for key, value in vars(old).items():
        if not key.startswith("_"):
            setattr(new, key, value)


def _move_forward_hooks(old: nn.Module, new: nn.Module) -> int:
    """Give ``new`` the forward hooks of ``old`` (same hook dictionaries where ``new`` has
    none, so the handles returned when they were registered still remove them)."""
    moved = len(getattr(old, "_forward_pre_hooks", {})) + len(getattr(old, "_forward_hooks", {}))
    for attr in _FORWARD_HOOK_DICTS:
        src = getattr(old, attr, None)
        if src is None:
            continue
        dst = getattr(new, attr, None)
        if not dst:
            object.__setattr__(new, attr, src)
        else:
            dst.update(src)
    return moved


def convert_to_te(
    module: nn.Module,
    *,
    tp_group,
    tp_size: int,
    sequence_parallel: bool = False,
    fuse_layernorm: bool = False,
) -> TEConversionReport:
    """Replace the tensor-parallel linear layers of ``module`` (in place) by
    ``transformer_engine.pytorch.Linear`` layers that compute exactly the same thing.

    Call it after ``apply_tp_plan`` and ``enable_sequence_parallel`` (it reads each layer's
    communication as configured) and before the gradient buffer and the optimizers are built
    (it replaces the parameters). The module must already be on its CUDA device (TE
    allocates its parameters there). See the module docstring for what converts, what stays
    and why; the returned :class:`TEConversionReport` lists every layer.

    Args:
        module: the module ``apply_tp_plan`` rewrote.
        tp_group: the tensor-parallel group (``None`` only with ``tp_size=1``).
        tp_size: its size; every layer must have been built for it.
        sequence_parallel: the strategy's setting, checked against the layers.
        fuse_layernorm: ``True`` is refused (see the module docstring).
    """
    _check_arguments(module, tp_group, tp_size, sequence_parallel, fuse_layernorm)
    candidates = [(n, m) for n, m in module.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    report = TEConversionReport(tp_size=tp_size, layernorm_fusion=_NO_FUSION if candidates else "")
    if not candidates:
        return report
    _check_layers(candidates, tp_size, sequence_parallel)
    holders: dict[int, list[str]] = {}
    for pn, p in module.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(pn)
    sites = _holding_sites(module)
    paths: dict[int, set[str]] = {}
    for n, x in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(x), set()).add(n)
    decisions = [(n, m, *_decide(m, holders, paths[id(m)])) for n, m in candidates]
    for n, m, mode, _ in decisions:
        if mode != "keep":
            for pname, p in m.named_parameters(recurse=False):
                _check_param_state(join_name(n, pname), p)

    te = import_transformer_engine() if any(d[2] != "keep" for d in decisions) else None
    for n, m, mode, text in decisions:
        if mode == "keep":
            report.kept.append(KeptLayer(n, type(m).__name__, text))
        else:
            report.converted.append(_convert_layer(te, n, m, mode, text, tp_group, tp_size, sites))
    return report


def _check_arguments(module: Any, tp_group, tp_size: Any, sequence_parallel: bool, fuse_layernorm: bool) -> None:
    if not isinstance(module, nn.Module):
        raise MegatronConfigError(f"convert_to_te needs an nn.Module, got {type(module).__name__}.")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise MegatronConfigError(f"tp_size={tp_size!r}: must be a positive integer (the tensor-parallel size).")
    if tp_group is None and tp_size > 1:
        raise MegatronConfigError(
            f"tp_group=None with tp_size={tp_size}: pass the tensor-parallel process group (ParallelState.tp_group)."
        )
    if tp_group is not None and group_world_size(tp_group) != tp_size:
        raise MegatronConfigError(
            f"tp_size={tp_size} but tp_group has {group_world_size(tp_group)} ranks; pass the size of the group."
        )
    if fuse_layernorm:
        raise MegatronConfigError(
            f"fuse_layernorm=True: folding norms into te.pytorch.LayerNormLinear is {_NO_FUSION}. "
            "Use fuse_layernorm=False: the norms stay torch modules and the linear layers' GEMMs run in TE."
        )
    if sequence_parallel and tp_size < 2:
        raise MegatronConfigError(
            f"sequence_parallel=True with tp_size={tp_size}: sequence parallelism needs tp > 1; "
            "use sequence_parallel=False."
        )


def _check_layers(candidates: list[tuple[str, nn.Module]], tp_size: int, sequence_parallel: bool) -> None:
    """Every layer was built for ``tp_size`` and runs sequence parallel exactly when the strategy does."""
    for n, m in candidates:
        if m.tp_size != tp_size:
            raise MegatronConfigError(
                f"convert_to_te(tp_size={tp_size}): {n} ({type(m).__name__}) was built for tp={m.tp_size}; "
                "convert with the tensor-parallel size the plan was applied with."
            )
    sp_layers = [n for n, m in candidates if m.sequence_parallel]
    if sp_layers and not sequence_parallel:
        raise MegatronConfigError(
            f"sequence_parallel=False, but {', '.join(sp_layers[:3])}{' ...' if len(sp_layers) > 3 else ''} "
            "run sequence parallel; pass sequence_parallel=True (the strategy's setting)."
        )
    if sequence_parallel and not sp_layers:
        raise MegatronConfigError(
            "sequence_parallel=True, but no column/row-parallel layer is set up for it; call "
            "enable_sequence_parallel(...) before convert_to_te, which converts each layer as it is configured."
        )


def _holding_sites(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (parent, attribute) that holds each module object, so shared layers are all replaced."""
    sites: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in {id(x): x for x in module.modules()}.values():
        for attr, child in parent._modules.items():
            if child is not None:
                sites.setdefault(id(child), []).append((parent, attr))
    return sites


def _convert_layer(
    te, n: str, m: nn.Module, mode: str, text: str, tp_group, tp_size: int, sites: dict
) -> ConvertedLayer:
    """Build the TE layer for ``m``, carry its parameters and hooks over, and put it in its place."""
    new = _build(te, m, mode, tp_group, tp_size)
    _carry_parameter(join_name(n, "weight"), m.weight, new.weight)
    if m.bias is not None:
        _carry_parameter(join_name(n, "bias"), m.bias, new.bias)
    new.train(m.training)
    moved = _move_forward_hooks(m, new)
    if mode == "local":
        # after the moved pre-hooks: they ran before the torch layer's forward body did this
        new.register_forward_pre_hook(TorchColumnInput(m.group, m.input_copy, m.sequence_parallel, m.sequence_dim))
    for parent, attr in sites.get(id(m), []):
        setattr(parent, attr, new)
    detail = text + (f"; {moved} forward hook(s) moved" if moved else "")
    return ConvertedLayer(
        name=n,
        torch_type=type(m).__name__,
        te_type=type(new).__name__,
        parallel_mode=None if mode == "local" else mode,
        sequence_parallel=bool(m.sequence_parallel),
        detail=detail,
    )
