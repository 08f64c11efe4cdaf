""":func:`apply_tp_plan`: rewrite the module in place following a resolved plan, after checking
that the plan still describes the module (types, ties, fix-up values)."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.builtin_plans import is_conv1d
from megastrategy.layers.plan.dotted_attrs import get_dotted, set_dotted_on_own_copy
from megastrategy.layers.plan.layer_kinds import features, type_name
from megastrategy.layers.plan.resolved import PlanEntry, ResolvedPlan
from megastrategy.layers.plan.rng_hooks import RNGRegionHooks
from megastrategy.naming import join_name, parent_name

__all__ = ["apply_tp_plan"]


def apply_tp_plan(module: nn.Module, plan: ResolvedPlan, *, group, rng_tracker) -> None:
    """Rewrite ``module`` in place following ``plan`` (from :func:`resolve_tp_plan`).

    Sharded layers are built from the user's layers (their weights are sliced, never
    re-initialized) and set on every parent that holds them. Ties (a vocab head sharing its
    embedding's weight; a head bias aliased on its parent, as Hugging Face BERT does) are
    checked by Parameter identity before anything is replaced and hold one Parameter after.
    Column layers under one parent share a ``SharedInputCopy``. Attribute fix-ups are set and
    attention-dropout regions are hooked to ``rng_tracker.fork()``.

    ``rng_tracker`` may be ``None`` only if the plan has no dropout on sharded activations.
    Hugging Face ``model.tie_weights()`` afterwards re-assigns the same sharded Parameter
    (harmless); ``resize_token_embeddings`` is not supported on a sharded model.
    """
    _check_arguments(plan, group, rng_tracker)
    modules = dict(module.named_modules())
    sites = _holding_sites(module)
    _check_module_types(modules, plan)
    _check_ties_hold(module, modules, plan)
    _check_fixups_expected(module, modules, plan)
    builder = _ShardedLayerBuilder(modules, group, rng_tracker)
    for e in sorted(plan.sharded, key=_build_order):
        old = modules[e.name]
        new = builder.build(e)
        new.train(old.training)
        for parent, attr in sites[id(old)]:
            setattr(parent, attr, new)
        for attr in e.extra.get("bias_aliases", ()):
            setattr(_parent_module(module, modules, e.name), attr, new.bias)
    copied: set[int] = set()
    for f in plan.fixups:
        set_dotted_on_own_copy(modules[f.module] if f.module else module, f.attr, f.new, copied)
    _hook_rng_regions(module, modules, builder.replaced, plan, rng_tracker)


def _parent_module(module: nn.Module, modules: dict[str, nn.Module], name: str) -> nn.Module:
    return modules[parent_name(name)] if parent_name(name) else module


def _check_arguments(plan: Any, group, rng_tracker) -> None:
    import torch.distributed as dist

    if not isinstance(plan, ResolvedPlan):
        raise MegatronConfigError(f"plan={plan!r} must be a ResolvedPlan from resolve_tp_plan().")
    world = dist.get_world_size(group)
    if world != plan.tp_size:
        raise MegatronConfigError(
            f"plan was resolved for tp={plan.tp_size} but group has {world} ranks; resolve the plan with "
            f"tp_size={world} (the size of the tensor-parallel group)."
        )
    needs_rng = plan.rng_regions or any(e.style in ("dropout", "attention") for e in plan.entries)
    if needs_rng and rng_tracker is None:
        raise MegatronConfigError(
            "rng_tracker=None: the plan has dropout on tensor-parallel activations (attention dropout of local "
            "heads or dropout between column and row layers), which needs a ModelParallelRNGTracker; pass "
            "rng_tracker=ModelParallelRNGTracker(tp_rank=..., device=...)."
        )


def _holding_sites(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (parent, attribute) that holds each module object, so shared modules are all replaced."""
    sites: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for parent in {id(m): m for m in module.modules()}.values():
        for attr, child in parent._modules.items():
            if child is not None:
                sites[id(child)].append((parent, attr))
    return sites


def _check_module_types(modules: dict[str, nn.Module], plan: ResolvedPlan) -> None:
    for e in plan.sharded:
        m = modules.get(e.name)
        if m is None or type_name(m) != e.module_type:
            found = "no such module" if m is None else f"a {type_name(m)}"
            raise MegatronConfigError(
                f"plan entry {e.name!r} ({e.style}) expects a {e.module_type} but the module has {found}; "
                "resolve the plan on this module right before applying it (was it applied twice?)."
            )


def _check_ties_hold(module: nn.Module, modules: dict[str, nn.Module], plan: ResolvedPlan) -> None:
    """Ties, by Parameter identity, before anything is replaced."""
    for e in plan.sharded:
        tied = e.extra.get("tied_to")
        if tied is not None and modules[e.name].weight is not modules[tied].weight:
            raise MegatronConfigError(
                f"plan says {e.name}.weight is tied to {tied}.weight but they are different Parameters now; "
                "resolve the plan again."
            )
        for attr in e.extra.get("bias_aliases", ()):
            if getattr(_parent_module(module, modules, e.name), attr, None) is not modules[e.name].bias:
                raise MegatronConfigError(
                    f"plan says {join_name(parent_name(e.name), attr)} aliases {e.name}.bias but it no longer does; "
                    "resolve the plan again."
                )


def _check_fixups_expected(module: nn.Module, modules: dict[str, nn.Module], plan: ResolvedPlan) -> None:
    for f in plan.fixups:
        owner = modules[f.module] if f.module else module
        if get_dotted(owner, f.attr) != f.old:
            raise MegatronConfigError(
                f"plan fix-up {join_name(f.module, f.attr)}: expected {f.old!r}, found {get_dotted(owner, f.attr)!r}; "
                "resolve the plan on this module right before applying it (was it applied twice?)."
            )


def _build_order(e: PlanEntry) -> int:
    """Embeddings first, heads last: a tied head is built from its already-sharded embedding."""
    if e.style == "vocab":
        return 0 if e.extra.get("vocab_layer") == "embedding" else 2
    return 1


def _as_linear(m: nn.Module) -> nn.Linear:
    """A Conv1D's weight as a (meta-built) nn.Linear view ``[out, in]``; nn.Linear as is."""
    if not is_conv1d(m):
        return m
    fin, fout = features(m)
    lin = nn.Linear(fin, fout, bias=m.bias is not None, device="meta")
    lin.weight = nn.Parameter(m.weight.detach().t(), requires_grad=m.weight.requires_grad)
    if m.bias is not None:
        lin.bias = m.bias
    return lin


class _ShardedLayerBuilder:
    """Builds the sharded replacement of each entry; remembers what it built (a tied head needs
    its embedding's) and the ``SharedInputCopy`` of each parent."""

    def __init__(self, modules: dict[str, nn.Module], group, rng_tracker) -> None:
        self.modules = modules
        self.group = group
        self.rng_tracker = rng_tracker
        self.input_copies: dict[str, Any] = {}
        self.replaced: dict[str, nn.Module] = {}

    def build(self, e: PlanEntry) -> nn.Module:
        build = {
            "column": self._column,
            "row": self._row,
            "vocab": self._vocab,
            "attention": self._attention,
            "dropout": self._dropout,
            "grad_sum": self._grad_sum,
            "head_table": self._head_table,
            "head_bias_input": self._head_bias_input,
            "head_vector": self._head_vector,
            "multi_query": self._multi_query,
            "kv_whole": self._kv_whole,
        }.get(e.style)
        if build is None:
            raise AssertionError(e.style)
        new = build(e, self.modules[e.name])
        self.replaced[e.name] = new
        return new

    def _input_copy(self, e: PlanEntry):
        from megastrategy.layers.mappings import SharedInputCopy

        key = e.extra.get("input_copy")
        if key is None:
            return None
        if key not in self.input_copies:
            self.input_copies[key] = SharedInputCopy(self.group)
        return self.input_copies[key]

    def _column(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.linear import ColumnParallelLinear

        chunks = int(e.extra.get("packed_chunks", 1))
        kw = dict(
            group=self.group,
            packed_chunks=chunks,
            packed_sections=tuple(e.extra.get("packed_sections", ())),
            input_copy=self._input_copy(e),
            gather_output=bool(e.extra.get("gather_output", False)),
        )
        if is_conv1d(m):
            # a transposed view (not detached): from_weight copies it and keeps requires_grad
            return ColumnParallelLinear.from_weight(m.weight.t(), m.bias, **kw)
        return ColumnParallelLinear.from_linear(m, **kw)

    def _row(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.linear import RowParallelLinear

        parallel_input = not e.extra.get("split_input", False)
        if is_conv1d(m):
            return RowParallelLinear.from_weight(m.weight.t(), m.bias, group=self.group, input_is_parallel=parallel_input)
        return RowParallelLinear.from_linear(m, group=self.group, input_is_parallel=parallel_input)

    def _vocab(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.embedding import VocabParallelEmbedding
        from megastrategy.layers.vocab_head import VocabParallelHead

        if isinstance(m, nn.Embedding):
            return VocabParallelEmbedding.from_embedding(m, group=self.group)
        tied = e.extra.get("tied_to")
        return VocabParallelHead.from_linear(
            _as_linear(m), group=self.group, tied_embedding=self.replaced[tied] if tied else None
        )

    def _attention(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.attention import TensorParallelMultiheadAttention

        return TensorParallelMultiheadAttention.from_module(m, group=self.group, rng_tracker=self.rng_tracker)

    def _dropout(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.random import TensorParallelRegionDropout

        return TensorParallelRegionDropout.from_dropout(m, self.rng_tracker)

    def _grad_sum(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.grad_sum import sum_grads_over_tp

        sum_grads_over_tp(m, self.group)
        return m

    def _head_table(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.head_bias import narrow_head_table

        return narrow_head_table(m, self.group, int(e.extra["heads"]))

    def _head_bias_input(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.head_bias import narrow_head_bias_input

        return narrow_head_bias_input(m, self.group, int(e.extra["heads"]), str(e.extra["bias_kwarg"]))

    def _head_vector(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.head_vectors import narrow_head_vectors

        return narrow_head_vectors(m, self.group, tuple(e.extra["params"]))

    def _multi_query(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.multi_query import MultiQueryLayout, MultiQueryPackedLinear

        layout = MultiQueryLayout(int(e.extra["q_heads"]), int(e.extra["kv_heads"]), int(e.extra["head_dim"]),
                                  interleaved=bool(e.extra.get("interleaved", False)))
        return MultiQueryPackedLinear(m, layout, self.group)

    def _kv_whole(self, e: PlanEntry, m: nn.Module) -> nn.Module:
        from megastrategy.layers.multi_query import MultiQueryPackedLinear

        return MultiQueryPackedLinear(m, None, self.group, kv_heads=int(e.extra.get("kv_heads", 1)))


def _hook_rng_regions(
    module: nn.Module, modules: dict[str, nn.Module], replaced: dict[str, nn.Module], plan: ResolvedPlan, rng_tracker
) -> None:
    for region in plan.rng_regions:
        owner = modules[region.module] if region.module else module
        hooks = RNGRegionHooks(rng_tracker, region.dropout_p)
        owner.register_forward_pre_hook(hooks.enter)
        owner.register_forward_hook(hooks.leave, always_call=True)
        if region.until is not None:
            until = replaced.get(region.until) or modules[region.until]
            until.register_forward_pre_hook(hooks.leave_early)
