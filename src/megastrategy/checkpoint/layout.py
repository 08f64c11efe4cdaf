"""How every tensor a rank holds maps onto the user's ORIGINAL (unsharded) tensor.

The checkpoint stores each entry of the user's ``state_dict`` under its original name and
with its original shape -- the *canonical* form -- whatever the layout that wrote it. A
rank's tensor is one or more rectangular *chunks* of that canonical tensor:

* a replicated tensor is the whole canonical tensor (one chunk at offset 0);
* a sharded tensor (one with a :class:`~megastrategy.layers.shard_spec.ShardSpec`) holds
  ``padded_size / tp`` entries of the split dimension; only the REAL entries are chunks
  (vocabulary padding rows are dropped, so the canonical shape is the unpadded one);
* a packed projection (``packed_chunks = k``, fused QKV) holds ``k`` separate pieces,
  ``[q_r | k_r | v_r]``: ``k`` chunks at ``c * n + r * n/tp`` of the canonical ``[k*n, ...]``;
  with unequal ``packed_sections`` (grouped-query ``[q|k|v]``) each section ``c`` of ``n_c`` rows
  starting at ``s_c`` gives the chunk at ``s_c + r * n_c/tp`` (:meth:`ShardSpec.sections`);
* a layer built from a Hugging Face ``Conv1D`` stores its weight ``[out, in]`` while the
  user's tensor is ``[in, out]``: its chunks are transposed views.

MoE expert parameters split over expert tensor parallelism (``etp``) are chunks the same way,
over the expert-TP group; expert parallelism itself needs nothing for ``MoELayer`` (experts keep
their global index in their names, so each rank simply holds different keys). Hugging Face's
fused experts (one ``[E, ...]`` tensor) hold whole experts along dim 0: chunks over the EP group.

Names: ``TensorParallelMultiheadAttention`` keeps its packed projection in ``in_proj.weight``
/ ``in_proj.bias``; the user's ``nn.MultiheadAttention`` calls them ``in_proj_weight`` /
``in_proj_bias``. Pipeline stages keep global block indices, so their names need no change.
A user's ``AveragedModel`` (an EMA) holds deep copies that lost their split description: each
copied tensor is described by the one it averages (:mod:`.averaged_layout`), under its own name.

Every chunk is a view of the rank's tensor, so the same description serves saving (read the
views) and loading in place (write into them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor, nn

from megastrategy.layers.shard_spec import ShardSpec, get_shard_spec, shard_full_tensor
from megastrategy.moe.expert_attr import EXPERT_ATTR

__all__ = ["TensorLayout", "ModuleLayout", "module_layout", "canonical_names"]

Chunk = tuple[tuple[int, ...], Tensor]  # (offsets in the canonical tensor, view of the local tensor)


@dataclass(frozen=True)
class TensorLayout:
    """One local tensor as a set of chunks of the user's canonical tensor ``name``."""

    name: str
    spec: Optional[ShardSpec] = None
    transposed: bool = False  # local is stored [out, in], the user's tensor is [in, out]
    tp_rank: int = 0  # rank and size of the group the split dimension is spread over
    tp_size: int = 1
    group: str = "tp"  # which group that is: "tp", "etp" (expert tensor parallelism) or "ep" (fused experts)

    @property
    def sharded(self) -> bool:
        return self.spec is not None

    def _split_dim(self, ndim: int) -> int:
        assert self.spec is not None
        d = self.spec.dim
        if not -ndim <= d < ndim:
            raise ValueError(f"{self.name}: ShardSpec dim {d} out of range for a {ndim}-d tensor")
        return d % ndim

    def _check_transposable(self, local: Tensor) -> None:
        if self.transposed and local.dim() != 2:
            raise ValueError(f"{self.name}: only 2-d weights can be stored transposed, got {local.dim()}-d")

    def canonical_shape(self, local: Tensor) -> tuple[int, ...]:
        """The user's shape of this tensor, from a rank's local tensor."""
        self._check_transposable(local)
        shape = list(local.shape)
        if self.spec is not None:
            d = self._split_dim(local.dim())
            expected = self.spec.local_size(self.tp_size)
            if shape[d] != expected:
                raise ValueError(
                    f"{self.name}: local size {shape[d]} on dim {d} does not match its ShardSpec "
                    f"({self.spec}, tp={self.tp_size}: expected {expected})"
                )
            shape[d] = self.spec.full_size
        return tuple(reversed(shape)) if self.transposed else tuple(shape)

    def canonical_dim(self, ndim: int) -> Optional[int]:
        """The split dimension in the user's (canonical) orientation."""
        if self.spec is None:
            return None
        d = self._split_dim(ndim)
        return ndim - 1 - d if self.transposed else d

    def chunks(self, local: Tensor) -> list[Chunk]:
        """The real (non-padding) pieces of ``local``, as views, with their canonical offsets."""
        self._check_transposable(local)
        if self.spec is None:
            view = local.t() if self.transposed else local
            return [((0,) * view.dim(), view)]
        spec, world = self.spec, self.tp_size
        d = self._split_dim(local.dim())
        out: list[Chunk] = []
        at = 0  # where this section's local entries begin in ``local``
        for start, size, padded in spec.sections():  # equal chunks, or unequal packed sections
            per_rank = padded // world  # local entries of this section
            first = self.tp_rank * per_rank  # first entry this rank owns within the section
            real = max(0, min(per_rank, size - first))  # the rest is padding
            if real:
                view = local.narrow(d, at, real)
                offsets = [0] * local.dim()
                offsets[d] = start + first
                if self.transposed:
                    view, offsets = view.t(), offsets[::-1]
                out.append((tuple(offsets), view))
            at += per_rank
        return out

    def shard_full(self, full: Tensor) -> Tensor:
        """This rank's local tensor cut from the user's ``full`` tensor (padding rows are zeros)."""
        lin = full.t() if self.transposed else full
        if self.spec is None:
            return lin
        return shard_full_tensor(lin, self.spec, self.tp_rank, self.tp_size)


@dataclass
class ModuleLayout:
    """The canonical description of one rank's module.

    ``tensors``: module ``state_dict`` key -> (the tensor itself, with ``keep_vars``; its layout).
    ``param_names``: ``id(param)`` -> every canonical name the parameter has (tied ones have several).
    """

    tensors: dict[str, tuple[Tensor, TensorLayout]]
    param_names: dict[int, list[str]]

    def canonical(self) -> dict[str, tuple[Tensor, TensorLayout]]:
        """Canonical name -> (tensor, layout)."""
        return {lay.name: (t, lay) for t, lay in self.tensors.values()}


def canonical_names(module: nn.Module) -> dict[str, str]:
    """``{module state_dict key: user's original key}`` for the keys that differ."""
    from megastrategy.layers.attention import TensorParallelMultiheadAttention

    renames: dict[str, str] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, TensorParallelMultiheadAttention):
            p = f"{prefix}." if prefix else ""
            renames[f"{p}in_proj.weight"] = f"{p}in_proj_weight"
            renames[f"{p}in_proj.bias"] = f"{p}in_proj_bias"
    return renames


def _transposed_keys(module: nn.Module, plan: Any) -> set[str]:
    """Weights of layers built from a Hugging Face ``Conv1D`` (stored ``[in, out]`` by the user)."""
    if plan is None:
        return set()
    from megastrategy.layers.builtin_plans import is_conv1d

    modules = dict(module.named_modules(remove_duplicate=False))
    out = set()
    for entry in getattr(plan, "entries", ()):
        if entry.extra.get("weight_layout") != "in_out":
            continue
        m = modules.get(entry.name)
        if m is not None and not is_conv1d(m):  # replaced by a parallel layer (tp > 1)
            out.add(f"{entry.name}.weight" if entry.name else "weight")
    return out


def _tensor_layout(key: str, name: str, t: Tensor, tp_rank: int, tp_size: int, transposed: bool) -> TensorLayout:
    spec = get_shard_spec(t)
    if spec is not None:
        return TensorLayout(name=name, spec=spec, transposed=transposed, tp_rank=tp_rank, tp_size=tp_size)
    expert = getattr(t, EXPERT_ATTR, None)
    etp_dim = getattr(expert, "etp_dim", None)
    etp_size = int(getattr(expert, "etp_size", 1) or 1)
    if expert is not None and etp_dim is not None and etp_size > 1:
        # an even, unpadded split of the expert's full tensor over the expert-TP group
        full = t.size(etp_dim) * etp_size
        return TensorLayout(
            name=name,
            spec=ShardSpec(dim=etp_dim, full_size=full, padded_size=full),
            tp_rank=int(expert.etp_rank),
            tp_size=etp_size,
            group="etp",
        )
    ep_size = int(getattr(expert, "ep_size", 1) or 1)
    if expert is not None and getattr(expert, "ep_dim", None) is not None and ep_size > 1:
        # Hugging Face fused experts: whole experts, dim 0 of [E, ...], split over the EP group
        full = t.size(expert.ep_dim) * ep_size
        return TensorLayout(name=name, spec=ShardSpec(dim=expert.ep_dim, full_size=full, padded_size=full),
                            tp_rank=int(expert.ep_rank), tp_size=ep_size, group="ep")
    return TensorLayout(name=name, transposed=transposed, tp_rank=tp_rank, tp_size=tp_size)


def _source_key(key: str, sources: dict[str, str]) -> str:
    for copy, source in sources.items():
        if key.startswith(copy):
            return source + key[len(copy):]
    return key


def module_layout(module: nn.Module, tp_rank: int = 0, tp_size: int = 1, plan: Any = None) -> ModuleLayout:
    """Describe every ``state_dict`` entry of ``module`` (a rank's sharded and/or cut module).

    ``plan`` (the strategy's ``ResolvedPlan``) is only needed for models with Hugging Face
    ``Conv1D`` layers: it is where the ``[in, out]`` storage of the original is recorded.
    """
    from megastrategy.checkpoint.averaged_layout import averaged_sources

    renames = canonical_names(module)
    transposed = _transposed_keys(module, plan)
    sources = averaged_sources(module)
    state = module.state_dict(keep_vars=True)
    tensors: dict[str, tuple[Tensor, TensorLayout]] = {}
    seen_canonical: dict[str, str] = {}
    for key, t in state.items():
        if not isinstance(t, Tensor):
            continue
        if key == "_extra_state" or key.endswith("._extra_state"):
            continue  # Transformer Engine's FP8 scaling state: not a tensor of the user's model
        name = renames.get(key, key)
        if name in seen_canonical:
            raise ValueError(f"state_dict keys {seen_canonical[name]!r} and {key!r} both map to {name!r}")
        seen_canonical[name] = key
        src = _source_key(key, sources)  # an AveragedModel's copy: split like what it averages
        tensors[key] = (t, _tensor_layout(src, name, state[src], tp_rank, tp_size, src in transposed))
    param_names: dict[int, list[str]] = {}
    for key, p in module.named_parameters(remove_duplicate=False):
        if key in tensors:
            param_names.setdefault(id(p), []).append(tensors[key][1].name)
    return ModuleLayout(tensors=tensors, param_names=param_names)

