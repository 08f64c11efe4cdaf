"""Save and load a rank's module and optimizers as one canonical, resharding DCP checkpoint.

Keys in the checkpoint (flat; ``/`` never occurs in a module name):

``model/<name>``
    every entry of the user's ORIGINAL ``state_dict`` (original name and shape; tied
    parameters appear under each of their names, as in ``state_dict()``).
``optim/<i>/state/<name>/<key>``
    optimizer ``i``'s state of parameter ``<name>`` (every name of a tied parameter).
    State tensors with the parameter's shape (Adam's moments) are sharded exactly like the
    parameter; scalars (``step``) are plain tensors; other values are stored as objects.
``optim/<i>/param_groups``
    the groups' hyperparameters (everything but ``params``), one dict per group.
``meta/info``
    format, the layout that wrote the checkpoint, the pipeline stack path, optimizer count.
``meta/order/<global rank>``
    that rank's pipeline stage and model keys in ``state_dict`` order (to restore the order).
``meta/lightning``
    everything else in Lightning's checkpoint dict (written by global rank 0).
``meta/rank_state/<global rank>``
    what differs per rank and must survive a resume on the same layout: random states
    (:mod:`.rng`) and the training loader's epoch-start state (:mod:`.resumable_loader`).

Nothing about the writer's layout is needed to read it: a loader describes its OWN tensors
as chunks of the canonical tensors and DCP reads the overlapping pieces.
"""
from __future__ import annotations

import warnings
from collections import namedtuple
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megastrategy.checkpoint.dcp_io import (
    MeshCache,
    PathLike,
    load_state,
    read_metadata,
    save_state,
    template_for,
    to_dcp_object,
)
from megastrategy.checkpoint.compatibility import check_model_matches, check_optimizers_match, optimizer_record
from megastrategy.checkpoint.layout import ModuleLayout, TensorLayout, module_layout
from megastrategy.checkpoint.safe_unpickle import as_data

FORMAT = "megastrategy-dcp-v1"
MODEL = "model/"
INFO_KEY = "meta/info"
LIGHTNING_KEY = "meta/lightning"
ORDER_PREFIX = "meta/order/"
RANK_STATE_PREFIX = "meta/rank_state/"

#: what the loaders return, like ``nn.Module.load_state_dict``
IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])

__all__ = [
    "FORMAT",
    "save_sharded",
    "load_model_",
    "load_optimizer_states",
    "load_full_model_state",
    "read_info",
    "read_lightning_metadata",
    "read_rank_state",
    "read_rank_states",
    "load_full_state_dict",
]


def optim_state_prefix(i: int) -> str:
    return f"optim/{i}/state/"


def optim_groups_key(i: int) -> str:
    return f"optim/{i}/param_groups"


def _layout(module: nn.Module, parallel_state: Any, plan: Any) -> tuple[ModuleLayout, MeshCache]:
    if parallel_state is None:
        return module_layout(module, 0, 1, plan), MeshCache({})
    ps = parallel_state
    groups = {"tp": ps.tp_group if ps.tp_size > 1 else None, "etp": getattr(ps, "expert_tp_group", None),
              "ep": ps.ep_group if ps.ep_size > 1 else None}
    return module_layout(module, ps.tp_rank, ps.tp_size, plan), MeshCache(groups)


# -------------------------------------------------------------------------------------------- save
def _optimizer_objects(
    i: int, optimizer: torch.optim.Optimizer, osd: dict, layout: ModuleLayout, meshes: MeshCache
) -> dict[str, Any]:
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    canonical = layout.canonical()
    objects: dict[str, Any] = {}
    for idx, state in osd.get("state", {}).items():
        if not 0 <= int(idx) < len(flat):
            raise ValueError(f"optimizer {i}: state for parameter #{idx}, but the optimizer has {len(flat)} parameters")
        p = flat[int(idx)]
        names = layout.param_names.get(id(p))
        if not names:
            raise ValueError(
                f"optimizer {i}: parameter #{idx} (shape {tuple(p.shape)}) is not a parameter of the "
                "LightningModule, so its state cannot be named in the checkpoint."
            )
        lay = canonical[names[0]][1]
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape == p.shape:
                obj = to_dcp_object(lay, value, meshes)  # elementwise state: sharded like the parameter
            elif isinstance(value, Tensor):
                if lay.sharded and value.dim() > 0:
                    raise ValueError(
                        f"optimizer {i} state {key!r} of the sharded parameter {lay.name} has shape "
                        f"{tuple(value.shape)}, neither the parameter's {tuple(p.shape)} nor a scalar; "
                        "only elementwise and scalar optimizer states can be resharded."
                    )
                obj = value.detach()
            else:
                obj = value
            for name in names:
                objects[f"{optim_state_prefix(i)}{name}/{key}"] = obj
    groups = [{k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])]
    objects[optim_groups_key(i)] = groups
    return objects


def save_sharded(
    path: PathLike,
    *,
    module: nn.Module,
    parallel_state: Any = None,
    optimizers: Optional[Sequence[torch.optim.Optimizer]] = None,
    optimizer_states: Optional[Sequence[dict]] = None,
    lightning: Optional[dict] = None,
    plan: Any = None,
    stack_path: Optional[str] = None,
    layout_record: Optional[dict] = None,
    is_coordinator: Optional[bool] = None,
    barrier: Optional[Callable[[], None]] = None,
    rank_state: Optional[dict] = None,
    write: Callable[..., None] = save_state,
) -> None:
    """Collective over the default group: write this rank's share of the model and optimizers.

    ``optimizers=None`` saves no optimizer state (a weights-only checkpoint); ``optimizer_states``
    are the optimizers' ``state_dict()`` (taken from the optimizers when omitted); ``lightning``
    is the object stored as ``meta/lightning`` (coordinator only); ``rank_state`` is stored as
    ``meta/rank_state/<this global rank>``; ``write`` is :func:`~.dcp_io.save_state` or an
    :class:`~.async_writer.AsyncCheckpointWriter`'s ``submit``.
    """
    if is_coordinator is None:
        is_coordinator = not dist.is_initialized() or dist.get_rank() == 0
    layout, meshes = _layout(module, parallel_state, plan)
    objects: dict[str, Any] = {}
    with torch.no_grad():
        for _key, (t, lay) in layout.tensors.items():
            objects[MODEL + lay.name] = to_dcp_object(lay, t, meshes)
        if optimizer_states is not None and len(optimizer_states) != len(optimizers or ()):
            raise ValueError(f"{len(optimizer_states)} optimizer states for {len(optimizers or ())} optimizers")
        for i, opt in enumerate(optimizers or ()):
            osd = optimizer_states[i] if optimizer_states is not None else opt.state_dict()
            objects.update(_optimizer_objects(i, opt, osd, layout, meshes))
    pp_rank = parallel_state.pp_rank if parallel_state is not None else 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    objects[f"{ORDER_PREFIX}{rank}"] = {"pp": pp_rank, "keys": [lay.name for _, lay in layout.tensors.values()]}
    if rank_state is not None:
        objects[f"{RANK_STATE_PREFIX}{rank}"] = rank_state
    if is_coordinator:
        objects[INFO_KEY] = {
            "format": FORMAT,
            "layout": layout_record,
            "stack_path": stack_path,
            "num_optimizers": None if optimizers is None else len(optimizers),
            "optimizers": None if optimizers is None else optimizer_record(optimizers),
            "torch": str(torch.__version__),
        }
        if lightning is not None:
            objects[LIGHTNING_KEY] = as_data(lightning)
    write(path, objects, is_coordinator=is_coordinator, **({"barrier": barrier} if barrier else {}))


# -------------------------------------------------------------------------------------------- read
def _read_objects(path: PathLike, keys: Iterable[str]) -> dict[str, Any]:
    md = read_metadata(path).state_dict_metadata
    objects = {k: None for k in keys if k in md and isinstance(md[k], BytesStorageMetadata)}
    return load_state(path, objects)


def read_info(path: PathLike) -> dict[str, Any]:
    """The ``meta/info`` record (format, writer's layout, ...)."""
    info = _read_objects(path, [INFO_KEY]).get(INFO_KEY)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ValueError(f"{path} is a DCP checkpoint but not one written by megastrategy ({FORMAT}).")
    return info


def read_lightning_metadata(path: PathLike) -> dict[str, Any]:
    """Lightning's part of the checkpoint (loops, callbacks, epoch, hparams, ...)."""
    return dict(_read_objects(path, [LIGHTNING_KEY]).get(LIGHTNING_KEY) or {})


def read_rank_state(path: PathLike, rank: int) -> Optional[dict[str, Any]]:
    """Global rank ``rank``'s ``meta/rank_state`` record (``None`` when the checkpoint has none)."""
    return _read_objects(path, [f"{RANK_STATE_PREFIX}{rank}"]).get(f"{RANK_STATE_PREFIX}{rank}")


def read_rank_states(path: PathLike, ranks: Iterable[int]) -> list[dict[str, Any]]:
    """The ``meta/rank_state`` records of ``ranks`` that the checkpoint holds (one read)."""
    keys = [f"{RANK_STATE_PREFIX}{r}" for r in ranks]
    loaded = _read_objects(path, keys)
    return [loaded[k] for k in keys if loaded.get(k) is not None]


def merge_orders(orders: Iterable[list[str]]) -> list[str]:
    """One order from several partial ones (ranks of one stage holding different experts):
    a key new to the result goes right before the next key of its own list already placed."""
    result: list[str] = []
    for keys in orders:
        placed = set(result)
        pending: list[str] = []
        for k in keys:
            if k not in placed:
                pending.append(k)
                continue
            if pending:
                at = result.index(k)
                result[at:at] = pending
                placed.update(pending)
                pending = []
        result += pending
    return result


def merged_key_order(stage_orders: dict[int, list[str]], stack_path: Optional[str]) -> list[str]:
    """The user's ``state_dict`` order from the pipeline stages' own orders.

    Each stage holds a subsequence of the original order: the modules before the layer stack
    (first stage), its blocks under their global indices, the modules after it (last stage).
    """
    prefix = f"{stack_path}." if stack_path else None
    pre: list[str] = []
    post: list[str] = []
    blocks: dict[int, list[str]] = {}
    seen: set[str] = set()
    for _, keys in sorted(stage_orders.items()):
        after_stack = False
        for k in keys:
            if k in seen:
                continue
            seen.add(k)
            if prefix and k.startswith(prefix) and k[len(prefix) :].split(".", 1)[0].isdigit():
                blocks.setdefault(int(k[len(prefix) :].split(".", 1)[0]), []).append(k)
                after_stack = True
            else:
                (post if after_stack else pre).append(k)
    return pre + [k for i in sorted(blocks) for k in blocks[i]] + post


def load_full_model_state(path: PathLike, *, prefix: str = MODEL) -> dict[str, Tensor]:
    """Every model tensor, whole, in the user's names, shapes and ``state_dict`` order.

    Needs no process group (reads the files directly); holds the full model in memory (for a
    model too large for that, :mod:`megastrategy.checkpoint.streaming` reads one tensor at a time).
    """
    from megastrategy.checkpoint.streaming import model_key_order

    md = read_metadata(path).state_dict_metadata
    order = model_key_order(path, prefix)
    loaded = load_state(path, {k: template_for(md[k]) for k in order})
    return {k[len(prefix) :]: loaded[k] for k in order}


# -------------------------------------------------------------------------------------------- load
def load_model_(
    path: PathLike,
    module: nn.Module,
    parallel_state: Any = None,
    *,
    plan: Any = None,
    strict: bool = True,
) -> IncompatibleKeys:
    """Load the checkpoint's model IN PLACE into this rank's (sharded and/or cut) ``module``.

    Only this rank's chunks are read. ``missing_keys``: the module's keys the checkpoint lacks
    (an error when ``strict``); ``unexpected_keys`` is always empty (with pipeline stages the
    checkpoint legitimately holds keys of other stages).
    """
    md = read_metadata(path).state_dict_metadata
    layout, meshes = _layout(module, parallel_state, plan)
    here = {lay.name: tuple(lay.canonical_shape(t)) for t, lay in layout.tensors.values()}
    check_model_matches(path, saved_model_shapes(md), here, strict=strict, whole=False)
    missing = [name for name in here if MODEL + name not in md]
    objects: dict[str, Any] = {}
    with torch.no_grad():
        for _key, (t, lay) in layout.tensors.items():
            if MODEL + lay.name in md:
                objects[MODEL + lay.name] = to_dcp_object(lay, t, meshes)
        load_state(path, objects)
    return IncompatibleKeys(missing, [])


def saved_model_shapes(md: dict[str, Any]) -> dict[str, tuple]:
    """The checkpoint's model tensors with their (unsharded, unpadded) shapes, in saved order."""
    return {k[len(MODEL):]: tuple(v.size) if isinstance(v, TensorStorageMetadata) else ("an object",)
            for k, v in md.items() if k.startswith(MODEL)}


def load_optimizer_states(
    path: PathLike,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    parallel_state: Any = None,
    *,
    plan: Any = None,
) -> list[dict[str, Any]]:
    """Torch-format ``state_dict()``s for ``optimizers`` over THIS rank's parameters.

    Templates in the current layout are built from the checkpoint's metadata, filled by DCP
    (only this rank's chunks are read), and numbered like ``optimizer.state_dict()`` numbers
    the current parameters, so ``optimizer.load_state_dict`` takes them as they are.
    """
    check_optimizers_match(path, read_info(path).get("optimizers"), optimizers)
    md = read_metadata(path).state_dict_metadata
    layout, meshes = _layout(module, parallel_state, plan)
    templates = _OptimizerTemplates(md, layout, meshes)
    plans: list[list[_StateEntry]] = []
    for i, opt in enumerate(optimizers):
        gkey = optim_groups_key(i)
        if gkey not in md:
            raise ValueError(
                f"{path} holds the state of fewer optimizers than the {len(optimizers)} configured "
                f"(no {gkey}); configure_optimizers must return the same optimizers as when it was saved."
            )
        templates.objects[gkey] = None
        plans.append(templates.entries(i, opt))
    if templates.unnamed:
        unnamed = templates.unnamed
        warnings.warn(
            f"{path}: no optimizer state saved for {len(unnamed)} parameter(s) ({unnamed[:5]}); "
            "they start with a fresh optimizer state.",
            stacklevel=2,
        )
    with torch.no_grad():
        loaded = load_state(path, templates.objects)
    return [_torch_optimizer_state(i, opt, entries, loaded) for i, (opt, entries) in enumerate(zip(optimizers, plans))]


#: one optimizer state tensor to load: (param index, dcp key, state key, DCP object or None, local tensor)
_StateEntry = tuple[int, str, str, Any, Optional[Tensor]]


def _saved_state_keys(md: dict[str, Any]) -> dict[int, dict[str, list[str]]]:
    """optimizer index -> saved parameter name -> [state keys], from the checkpoint's keys."""
    saved: dict[int, dict[str, list[str]]] = {}
    for k in md:
        if not k.startswith("optim/"):
            continue
        _, i, kind, rest = (k.split("/", 3) + ["", ""])[:4]
        if kind == "state" and "/" in rest:
            name, key = rest.split("/", 1)
            saved.setdefault(int(i), {}).setdefault(name, []).append(key)
    return saved


class _OptimizerTemplates:
    """DCP templates, in the current layout, for the optimizer states the checkpoint holds;
    ``objects`` is what DCP fills, ``unnamed`` the parameters it holds no state for."""

    def __init__(self, md: dict[str, Any], layout: ModuleLayout, meshes: MeshCache) -> None:
        self.md = md
        self.layout = layout
        self.canonical = layout.canonical()
        self.meshes = meshes
        self.saved = _saved_state_keys(md)
        self.objects: dict[str, Any] = {}
        self.unnamed: list[str] = []

    def entries(self, i: int, opt: torch.optim.Optimizer) -> list[_StateEntry]:
        """The state entries of optimizer ``i``, numbered as ``opt.state_dict()`` numbers params."""
        entries: list[_StateEntry] = []
        saved = self.saved.get(i, {})
        flat = [p for g in opt.param_groups for p in g["params"]]
        for idx, p in enumerate(flat):
            names = self.layout.param_names.get(id(p), [])
            name = next((n for n in names if n in saved), None)
            if name is None:
                if saved:
                    self.unnamed.append(names[0] if names else f"#{idx}")
                continue
            lay: TensorLayout = self.canonical[names[0]][1]
            for key in saved[name]:
                dkey = f"{optim_state_prefix(i)}{name}/{key}"
                obj, local = self._template(self.md[dkey], lay, p)
                self.objects[dkey] = obj
                entries.append((idx, dkey, key, obj, local))
        return entries

    def _template(self, smd: Any, lay: TensorLayout, p: Tensor) -> tuple[Any, Optional[Tensor]]:
        """(DCP object, local tensor): a shard of the parameter's layout for a state shaped like
        it, a whole tensor for any other tensor, nothing for a pickled object."""
        if isinstance(smd, BytesStorageMetadata):
            return None, None
        if p.dim() > 0 and smd.size == torch.Size(lay.canonical_shape(p)):
            local = torch.zeros_like(p, dtype=smd.properties.dtype, memory_format=torch.contiguous_format)
            return to_dcp_object(lay, local, self.meshes), local
        local = torch.zeros(smd.size, dtype=smd.properties.dtype, device=p.device)
        return local, local


def _torch_optimizer_state(
    i: int, opt: torch.optim.Optimizer, entries: list[_StateEntry], loaded: dict[str, Any]
) -> dict[str, Any]:
    """Optimizer ``i``'s loaded state as ``optimizer.load_state_dict`` takes it."""
    groups_saved = loaded[optim_groups_key(i)]
    if len(groups_saved) != len(opt.param_groups):
        raise ValueError(
            f"optimizer {i}: the checkpoint has {len(groups_saved)} parameter groups, the optimizer "
            f"{len(opt.param_groups)}; configure_optimizers must build the same groups."
        )
    groups, start = [], 0
    for g_saved, g in zip(groups_saved, opt.param_groups):
        groups.append({**g_saved, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    state: dict[int, dict[str, Any]] = {}
    for idx, dkey, key, obj, local in entries:
        state.setdefault(idx, {})[key] = loaded[dkey] if obj is None else local
    return {"state": state, "param_groups": groups}


def load_full_state_dict(
    module: nn.Module,
    full_state_dict: dict[str, Tensor],
    parallel_state: Any = None,
    *,
    plan: Any = None,
    strict: bool = True,
) -> IncompatibleKeys:
    """Load the user's full (unsharded) ``state_dict`` into an already sharded/cut ``module``.

    Each tensor is cut for this rank with :func:`~megastrategy.layers.shard_spec.shard_full_tensor`
    (vocabulary padding rows become zeros); no communication. Keys are the user's original
    names (``in_proj_weight``, ...), shapes the original ones. With ``parallel_state=None`` and
    ``plan=None`` they are taken from the Trainer's ``MegatronStrategy`` when ``module`` is
    attached to one (the plan matters only for Hugging Face ``Conv1D`` layers).

    Returns ``(missing_keys, unexpected_keys)``. With ``strict``, missing keys raise, and so do
    unexpected ones unless the module is one pipeline stage (the others hold them).
    """
    strategy = _attached_strategy(module)
    if parallel_state is None and strategy is not None:
        parallel_state = getattr(strategy, "parallel_state", None)
    if plan is None and strategy is not None:
        plan = getattr(strategy, "resolved_plan", None)
    layout, _ = _layout(module, parallel_state, plan)
    missing: list[str] = []
    used: set[str] = set()
    with torch.no_grad():
        for _key, (t, lay) in layout.tensors.items():
            full = full_state_dict.get(lay.name)
            if full is None:
                missing.append(lay.name)
                continue
            want = lay.canonical_shape(t)
            if tuple(full.shape) != want:
                raise ValueError(f"{lay.name}: the full state dict has shape {tuple(full.shape)}, this model {want}.")
            t.copy_(lay.shard_full(full.to(device=t.device)))
            used.add(lay.name)
    unexpected = [k for k in full_state_dict if k not in used]
    pp_size = getattr(parallel_state, "pp_size", 1) if parallel_state is not None else 1
    if strict and (missing or (unexpected and pp_size == 1)):
        raise KeyError(
            f"load_full_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10] if pp_size == 1 else []} "
            "(pass strict=False to load the matching ones)."
        )
    return IncompatibleKeys(missing, unexpected)


def _attached_strategy(module: nn.Module) -> Any:
    trainer = getattr(module, "_trainer", None)
    return getattr(trainer, "strategy", None) if trainer is not None else None


class DeferredOptimizerStates(Sequence):
    """``checkpoint["optimizer_states"]``, read on first use.

    Lightning reads the checkpoint before the strategy's ``setup`` (where the module is
    sharded and the optimizers are created) and loads the optimizer states after it; the
    templates depend on both, so the states are read when Lightning first iterates them.
    """

    def __init__(self, count: int, resolve: Callable[[], list[dict[str, Any]]]):
        self._count = count
        self._resolve = resolve
        self._value: Optional[list[dict[str, Any]]] = None

    def _get(self) -> list[dict[str, Any]]:
        if self._value is None:
            self._value = self._resolve()
        return self._value

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())

    def __repr__(self) -> str:
        state = "loaded" if self._value is not None else "not read yet"
        return f"DeferredOptimizerStates({self._count} optimizer(s), {state})"

