"""Structural plans: the last source of a tensor-parallel plan, for a Hugging Face model that
declares none and has no built-in rules (Falcon, Persimmon, ...).

The model runs once on random ids while :mod:`megastrategy.layers.dataflow` records which
linear layer's output reaches which linear layer's input. A linear layer ``out`` whose input
comes only from sibling linear layers fed at most two tensors (the hidden states; in
cross-attention the query's and the memory's), none of whose outputs goes anywhere else, closes a Megatron region: the siblings are ``column``, ``out`` is ``row``. The siblings may also sit in a
module beside ``out``'s, as in BERT's layout (``attention.self.query`` -> ``attention.output.dense``,
``intermediate.dense`` -> ``output.dense``: Data2Vec-vision, FNet, MobileViT, DeBERTa v1).

* If the parent counts heads (an ``int`` attribute in :data:`HEAD_ATTRS`) it is an
  **attention** block: the head counts are divided by ``tp`` (and must be divisible). One packed
  QKV projection is split by what the forward does first with its output: a ``view`` whose
  outer new dimension is a head count (``[heads, 3, head_dim]``, Falcon's
  ``[kv_groups, q_per_group + 2, head_dim]``) -> contiguous rows per rank; a ``split``/``chunk``
  into equal parts -> ``packed_chunks``; a ``split`` into ``(n_q·d, n_kv·d, n_kv·d)`` or a ``view``
  as ``[n_q + 2·n_kv, d]`` -> ``packed_sections`` when there are several key/value heads, and with
  one (multi-query: GPT-BigCode, Falcon) ``multi_query``, the query heads split and the key/value
  head computed whole on every rank (:mod:`megastrategy.layers.multi_query`; the key/value head
  counts are then not divided, the query groups ``num_key_value_groups`` are). Anything else, or
  both readings at once, is refused.
  Parameterized layers between the projections and ``out`` (per-head q/k norms) keep their
  weights whole and sum their gradients over TP (``grad_sum``); attention dropout on the local
  heads runs on the per-TP-rank RNG stream. A per-head bias table (an ``nn.Embedding`` child as
  wide as the head count: T5's relative position bias) is ``head_table``, and an attention
  taking a ``position_bias`` (T5, MPT) or ``alibi`` (Bloom) argument is ``head_bias_input`` (:mod:`megastrategy.layers.head_bias`).
  Cross-attention (q from the decoder, k/v from the encoder output) is two inputs, one region.
  Vectors of the attention itself as wide as its heads (DeBERTa v1's ``q_bias``/``v_bias``) are
  ``head_vector`` (:mod:`megastrategy.layers.head_vectors`). An attention that cannot run on local heads
  (Longformer's; one whose projections the probe never ran) stays whole: exact, its MLP is still sharded.
* Otherwise it is an **MLP**: up (and gate) ``column``, down ``row``.

The input and output embeddings become ``vocab``. Every detected block is verified in setup
against its unsharded copy (:mod:`megastrategy.layers.block_check`), so a wrong reading
refuses to train rather than train wrong. Pure: nothing is modified.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

from torch import nn

from megastrategy.layers.dataflow import DataFlow, FirstUse, trace_dataflow
from megastrategy.layers.multi_query import MultiQueryLayout, read_packed_qkv
from megastrategy.layers.random_ids_forward import forward_on_random_ids
from megastrategy.layers.unit_types import GROUP_ATTRS, HEAD_ATTRS, BuiltinUnit, KeyValueHeads, Refusal, SizeCheck, is_linear_layer
from megastrategy.naming import join_name, parent_name

__all__ = ["structural_units"]

#: attention arguments that carry a bias per head: T5's and MPT's ``position_bias``, Bloom's ``alibi``
_BIAS_ARGUMENTS = ("position_bias", "alibi")
_SPLIT_OPS = ("split", "chunk", "tensor_split", "split_with_sizes")
_VIEW_OPS = ("view", "reshape", "unflatten")


#: attentions whose forward cannot run on local heads, left whole (exact) while the rest of the model is
#: sharded. Longformer's compares ``embed_dim`` with its input's width and reshapes the heads' output to
#: that width (dividing ``embed_dim`` breaks the first, keeping it the second), and its global-attention
#: projections run only for tokens a global attention mask selects.
_KEEP_WHOLE = ("LongformerSelfAttention",)

#: attention attributes that may hold the heads' concatenated width (see ``_width_attrs``)
_WIDTH_ATTRS = ("embed_dim",)


def _head_counts(m: nn.Module) -> dict[str, int]:
    return {a: v for a in HEAD_ATTRS if isinstance(v := getattr(m, a, None), int) and not isinstance(v, bool)}


def _packing(use: FirstUse | None, heads: set[int]) -> int | MultiQueryLayout | str:
    """Equal chunks side by side in a packed projection's output (1: heads/groups outermost), a
    ``[q | k | v]`` layout with fewer key/value heads, or why that cannot be told."""
    if use is None:
        return "its output is never used"
    if use.op in _SPLIT_OPS:
        first = use.results[0] if use.results else ()
        k = len(use.results)
        if k > 1 and all(r == first for r in use.results) and first[-1] * k == use.shape[-1]:
            return k
        parts = [r[-1] for r in use.results]
        return read_packed_qkv("split", use.shape[-1], parts, heads) or f"its output is cut by {use.op} into unequal parts {parts}"
    if use.op in _VIEW_OPS and len(use.results) == 1:
        lead = len(use.shape) - 1
        result = use.results[0]
        suffix = result[lead:]
        if result[:lead] == use.shape[:lead] and len(suffix) == 2 and suffix[0] in heads:
            return 1  # [heads, 3 * head_dim], chunked per head afterwards (DeBERTa v1's in_proj)
        layout = read_packed_qkv("view", use.shape[-1], list(suffix), heads) if result[:lead] == use.shape[:lead] else None
        if layout is not None:
            return layout  # [q heads + 2 * kv heads, head_dim] (Falcon's multi-query)
        if result[:lead] == use.shape[:lead] and len(suffix) >= 3:
            readings = []
            if suffix[0] in heads:
                readings.append(1)  # [heads or kv groups, ..., head_dim]
            if suffix[0] in (2, 3) and suffix[1] in heads:
                readings.append(suffix[0])  # [q|k|v, heads, head_dim]
            if len(readings) == 1:
                return readings[0]
            return (
                f"its output is viewed as {list(suffix)} and the head counts {sorted(heads)} leave "
                + ("two readings (heads outermost, or equal q/k/v chunks)" if readings else "no reading")
            )
    return f"the forward first applies {use.op} to its output, giving shapes {list(use.results)}"


def _interleaved_groups(use: FirstUse | None, heads: set[int]) -> MultiQueryLayout | None:
    """Falcon's grouped layout: the packed output viewed as ``[kv groups, q per group + 2, head_dim]``
    (each group's query heads, key and value side by side); ``None`` for any other first use."""
    if use is None or use.op not in _VIEW_OPS or len(use.results) != 1 or not heads:
        return None
    lead, q = len(use.shape) - 1, max(heads)
    result = use.results[0]
    groups, per_group, head_dim = (tuple(result[lead:]) + (0, 0, 0))[:3] if len(result) == lead + 3 else (0, 0, 0)
    if result[:lead] != use.shape[:lead] or groups not in heads or not 0 < groups < q or q % groups:
        return None
    if per_group != q // groups + 2 or groups * per_group * head_dim != use.shape[-1]:
        return None
    return MultiQueryLayout(q, groups, head_dim, interleaved=True)


#: what an MLP's first layer feeds first; a packed q/k/v is cut first (split, view, unsqueeze, ...)
_ACTIVATIONS = ("gelu", "relu", "silu", "sigmoid", "tanh", "elu", "selu", "celu", "leaky_relu", "hardswish",
                "mish", "softplus", "relu6", "hardtanh", "glu")


def _feeds_activation(flow: DataFlow, sources: frozenset[str]) -> bool:
    """One projection whose output goes through an activation first (a GELU): an MLP, even in a
    module that counts heads (a hand-written block holding attention and MLP side by side)."""
    use = flow.first_use.get(next(iter(sources))) if len(sources) == 1 else None
    return use is not None and use.op.rstrip("_") in _ACTIVATIONS


class _Detector:
    """Reads one Hugging Face model's data flow; collects units and refusals."""

    def __init__(self, root_name: str, root: nn.Module, flow: DataFlow, linears: set[str], covered: set[str]) -> None:
        self.root_name, self.root, self.flow, self.linears, self.covered = root_name, root, flow, linears, covered
        self.modules = dict(root.named_modules())
        self.arch = str(getattr(getattr(root, "config", None), "model_type", type(root).__name__))
        self.units: list[BuiltinUnit] = []
        self.refused: list[Refusal] = []

    def full(self, rel: str) -> str:
        return join_name(self.root_name, rel)

    def region(self, out: str) -> frozenset[str] | None:
        """The column layers closed by ``out``, or None if ``out`` closes no clean region."""
        sources = self.flow.sources.get(out, frozenset())
        if not sources or out in sources or not sources <= self.linears:
            return None
        parent = _scope(out, sources)
        if parent is None:
            return None
        if len({self.flow.input_id.get(s) for s in sources}) > 2:  # one input, or a query and a memory
            return None
        leaks = [n for n, src in self.flow.sources.items() if n != out and src & sources and not n.startswith(parent + ".")]
        others = [n for n in self.linears if n != out and self.flow.sources.get(n, frozenset()) & sources]
        return None if leaks or others else sources

    def inside(self, owner: str, sources: frozenset[str], kind: type) -> list[str]:
        """Non-linear layers of ``owner`` of type ``kind`` that act on the region's activations."""
        found = []
        for n, src in self.flow.sources.items():
            m = self.modules[n]
            if n.startswith(owner + ".") and n not in self.linears and isinstance(m, kind) and src and src <= sources:
                found.append(n)
        return sorted(found)

    def add(self, out: str, sources: frozenset[str]) -> None:
        owner = parent_name(next(iter(sources)))  # holds the head counts (BERT's attention.self)
        scope = _scope(out, sources) or owner
        heads = _head_counts(self.modules[owner]) if owner else {}
        if not heads or _feeds_activation(self.flow, sources):
            members = [(self.full(s), "column", {}) for s in sorted(sources)]
            members += [(self.full(d), "dropout", {}) for d in self.inside(scope, sources, nn.Dropout)]
            members.append((self.full(out), "row", {}))
            self.units.append(BuiltinUnit(self.arch, "mlp", self.full(scope), members, origin="structural"))
            return
        if self.unrun_projections(owner) or type(self.modules[owner]).__name__ in _KEEP_WHOLE:
            return  # left whole: see unrun_projections, _KEEP_WHOLE
        chunks: int | MultiQueryLayout | str = 1
        grouped = None
        if len(sources) == 1:
            (packed,) = sources
            counts = {v for a, v in heads.items() if a != "all_head_size"}
            chunks = _packing(self.flow.first_use.get(packed), counts)
            if isinstance(chunks, str):
                self.refused.append(Refusal(self.full(owner), "structural", (
                    f"structural detection cannot tell how the packed projection {self.full(packed)!r} holds "
                    f"q/k/v: {chunks}"), origin="structural"))
                return
            grouped = _interleaved_groups(self.flow.first_use.get(packed), counts) if chunks == 1 else None
        unit = self._attention(owner, out, sources, chunks, heads)
        if grouped is not None:
            unit.kv_heads = self._replicable_groups(owner, next(iter(sources)), grouped, heads)
        self.units.append(unit)

    def _replicable_groups(self, owner: str, packed: str, grouped: MultiQueryLayout, heads: dict[str, int]) -> KeyValueHeads:
        """Falcon's key/value groups, replicated where tp exceeds them (:mod:`megastrategy.layers.plan.kv_replication`)."""
        counts = tuple(a for a, v in heads.items() if v == grouped.kv_heads)
        return KeyValueHeads(grouped.kv_heads, grouped.q_heads, grouped.head_dim, (self.full(packed),), counts[0],
                             counts, packed=True, interleaved=True)

    def unrun_projections(self, owner: str) -> list[str]:
        """Linear layers of the attention ``owner`` that the probe forward never ran (Longformer's
        ``query_global``/``key_global``/``value_global``, used only under a global attention mask).
        How they read the heads is unknown, and sharding only the layers that ran would leave them
        reading the full heads of divided head counts, so the attention stays whole (exact); the
        rest of the model is still sharded."""
        return [n for n in self.linears if parent_name(n) == owner and n not in self.flow.sources]

    def _attention(
        self, owner: str, out: str, sources: frozenset[str], chunks: int | MultiQueryLayout, heads: dict[str, int]
    ) -> BuiltinUnit:
        scope = _scope(out, sources) or owner
        members, divided, checks = self._projections(owner, sources, chunks, heads)
        members += [(self.full(n), "grad_sum", {}) for n in self.inside(owner, sources, nn.Module)
                    if any(True for _ in self.modules[n].parameters(recurse=False))]
        dropouts = self.inside(scope, sources, nn.Dropout)
        members += [(self.full(d), "dropout", {}) for d in dropouts if not d.startswith(owner + ".")]
        members.append((self.full(out), "row", {}))
        members += self._head_bias(owner, heads)
        members += self._head_vectors(owner, out)
        dropouts = [d for d in dropouts if d.startswith(owner + ".")]
        # the owner's forward ends before ``out`` runs when ``out`` is its sibling's (BERT's attention.output)
        until = self.full(out) if out.startswith(owner + ".") else None
        rng = (until, f"{dropouts[0][len(owner) + 1:]}.p") if dropouts else None
        return BuiltinUnit(
            self.arch, "attention", self.full(owner), members, divide_attrs=divided + self._width_attrs(owner, out),
            checks=checks, rng_region=rng, origin="structural",
        )

    def _projections(
        self, owner: str, sources: frozenset[str], chunks: int | MultiQueryLayout, heads: dict[str, int]
    ) -> tuple[list[tuple[str, str, dict[str, Any]]], tuple[str, ...], list[SizeCheck]]:
        """The projections' entries, the head attributes divided by tp, and the sizes tp must divide.
        One key/value head (multi-query) stays whole: its counts are kept and the query groups divided."""
        names = [self.full(s) for s in sorted(sources)]
        checks = [SizeCheck(self.full(owner), a, v, "attention heads") for a, v in heads.items()]
        if not isinstance(chunks, MultiQueryLayout):
            extra: dict[str, Any] = {"packed_chunks": chunks} if chunks > 1 else {}
            return [(n, "column", dict(extra)) for n in names], tuple(heads), checks
        if chunks.kv_heads > 1:  # grouped: every section split over tp, each rank holding whole kv heads
            checks.append(SizeCheck(names[0], "key/value heads", chunks.kv_heads, "key/value heads"))
            return [(n, "column", {"packed_sections": chunks.sections}) for n in names], tuple(heads), checks
        kept = {a for a, v in heads.items() if v == chunks.kv_heads}
        module = self.modules[owner]
        groups = tuple(a for a in GROUP_ATTRS if getattr(module, a, None) == chunks.q_heads // chunks.kv_heads)
        checks = [c for c in checks if c.attr not in kept] + [SizeCheck(names[0], "query heads", chunks.q_heads, "query heads")]
        return [(n, "multi_query", chunks.as_extra()) for n in names], tuple(a for a in heads if a not in kept) + groups, checks

    def _width_attrs(self, owner: str, out: str) -> tuple[str, ...]:
        """Width attributes of the attention that equal the heads' concatenated width (what the row
        layer takes in): the unchanged forward reshapes its local heads with them (XGLM, TrOCR, MVP:
        ``attn_output.reshape(bsz, tgt_len, self.embed_dim)``), so they are divided like the head
        counts. The block check still compares the sharded attention with the original."""
        width = getattr(self.modules[out], "in_features", None)
        module = self.modules[owner]
        return tuple(a for a in _WIDTH_ATTRS if isinstance(width, int) and getattr(module, a, None) == width)

    def _head_vectors(self, owner: str, out: str) -> list[tuple[str, str, dict[str, Any]]]:
        """DeBERTa v1's ``q_bias``/``v_bias``: vectors of the attention itself as wide as the heads'
        concatenated width (what the row layer takes in), read by head (:mod:`megastrategy.layers.head_vectors`)."""
        width = getattr(self.modules[out], "in_features", None)
        params = tuple(n for n, p in self.modules[owner]._parameters.items()
                       if p is not None and p.dim() == 1 and p.shape[0] == width)
        return [(self.full(owner), "head_vector", {"params": params})] if params else []

    def _head_bias(self, owner: str, heads: dict[str, int]) -> list[tuple[str, str, dict[str, Any]]]:
        """T5's relative position bias: a per-head table (an Embedding whose width is the head
        count, or Swin's module holding a ``[positions, heads]`` table) and a ``position_bias``
        argument that carries one bias per head."""
        module = self.modules[owner]
        tables = [(n, m.embedding_dim) for n, m in module.named_children()
                  if type(m) is nn.Embedding and m.embedding_dim in heads.values()]
        tables += [(n, h) for n, m in module.named_children() if (h := _head_wide_table(m, set(heads.values())))]
        members = [(self.full(join_name(owner, n)), "head_table", {"heads": h}) for n, h in tables]
        params = inspect.signature(module.forward).parameters
        no_alibi = getattr(getattr(self.root, "config", None), "alibi", True) is False  # Falcon's default
        for kwarg in (k for k in _BIAS_ARGUMENTS if k in params and not (k == "alibi" and no_alibi)):
            h = tables[0][1] if tables else max(heads.values())
            members.append((self.full(owner), "head_bias_input", {"heads": h, "bias_kwarg": kwarg}))
        return members

    def vocab(self) -> None:
        """Input embedding and output head, once some block was detected. An embedding whose
        weight another embedding shares (an encoder-decoder's ``shared``), or whose class has its
        own ``forward`` (a scaled embedding), stays whole, and so does a head tied to it."""
        names = {id(m): n for n, m in self.modules.items() if self.full(n) not in self.covered}
        emb, head = _embeddings(self.root, "get_input_embeddings"), _embeddings(self.root, "get_output_embeddings")
        emb_ok = type(emb) is nn.Embedding and id(emb) in names and not self._shared_with_embeddings(emb)
        if emb_ok:
            self.units.append(BuiltinUnit(self.arch, "embedding", self.root_name, [(self.full(names[id(emb)]), "vocab", {})], origin="structural"))
        tied = emb is not None and head is not None and getattr(head, "weight", None) is getattr(emb, "weight", None)
        if isinstance(head, nn.Linear) and id(head) in names and (emb_ok or not tied):
            self.units.append(BuiltinUnit(self.arch, "lm_head", self.root_name, [(self.full(names[id(head)]), "vocab", {})], origin="structural"))

    def _shared_with_embeddings(self, emb: nn.Embedding) -> bool:
        return any(isinstance(m, nn.Embedding) and m is not emb and m.weight is emb.weight for m in self.modules.values())


def _scope(out: str, sources: frozenset[str]) -> str | None:
    """The module holding the whole region: the column layers' parent when it also holds ``out``
    (GPT's ``attn.q/k/v`` -> ``attn.o``), or the parent of both when the columns and ``out`` sit in
    sibling modules, as in BERT's layout (``attention.self.query`` -> ``attention.output.dense``,
    ``intermediate.dense`` -> ``output.dense``; Data2Vec-vision, FNet, MobileViT, DeBERTa v1);
    ``None`` when the columns have different parents or lie elsewhere."""
    parents = {parent_name(s) for s in sources}
    if len(parents) != 1:
        return None
    (parent,) = parents
    if parent_name(out) == parent:
        return parent
    if parent and parent_name(parent) == parent_name(parent_name(out)) and parent_name(out) != parent_name(parent):
        return parent_name(parent) or None
    return None


def _head_wide_table(m: nn.Module, heads: set[int]) -> int | None:
    """The head count of a leaf module (not an Embedding, not a linear layer) whose parameters are
    all ``[positions, heads]`` tables, as Swin's relative position bias: called by its attention,
    it returns a bias per head. ``None`` for any other module."""
    if type(m) is nn.Embedding or is_linear_layer(m) or any(True for _ in m.children()):
        return None
    shapes = [tuple(q.shape) for q in m.parameters(recurse=False)]
    widths = {shape[-1] for shape in shapes}
    if not shapes or any(len(shape) != 2 for shape in shapes) or len(widths) != 1:
        return None
    width = widths.pop()
    return width if width in heads else None


def _embeddings(root: nn.Module, getter: str) -> nn.Module | None:
    """``root.get_input_embeddings()`` (or the output one); ``None`` for a model without token
    embeddings (ConvNeXt, Wav2Vec2: transformers raises NotImplementedError)."""
    try:
        return getattr(root, getter)()
    except (NotImplementedError, AttributeError):
        return None


def _watched(root: nn.Module) -> tuple[dict[str, nn.Module], set[str]]:
    """Leaf layers to trace (linear layers cut the tags; the rest only read them)."""
    watched = {n: m for n, m in root.named_modules() if n and not any(True for _ in m.children())}
    return watched, {n for n, m in watched.items() if is_linear_layer(m)}


def _in_repeated_block(name: str) -> bool:
    """Inside an element of a layer list (``layers.3.attn.q``): where the compute is."""
    return any(part.isdigit() for part in name.split(".")[:-1])


def structural_units(
    root_name: str, root: nn.Module, covered: set[str], run: Callable[[], Any] | None = None, with_vocab: bool = True
) -> tuple[list[BuiltinUnit], list[Refusal]]:
    """Units found by tracing Hugging Face model ``root`` (named ``root_name`` in the user's
    module); layers in ``covered`` (named by another source) are left to it. ``run`` replaces the
    forward on random ids (a user's model, :mod:`megastrategy.layers.user_stack_plans`, runs on a
    guessed input), and ``with_vocab=False`` leaves its embeddings alone."""
    watched, all_linears = _watched(root)
    linears = {n for n in all_linears if join_name(root_name, n) not in covered and _in_repeated_block(n)}
    if not linears:
        return [], []
    flow = trace_dataflow(root, watched, all_linears, run or (lambda: forward_on_random_ids(root)))
    if flow is None:
        return [], []
    detector = _Detector(root_name, root, flow, linears, covered)
    for out in sorted(linears):
        sources = detector.region(out)
        if sources is not None:
            detector.add(out, sources)
    # a built-in rule that recognized some of this model's blocks (BERT-shaped by layout) decided about its
    # embeddings and head: MobileBERT's head multiplies by its decoder's weight itself, so both stay whole
    ruled = any(n == root_name or n.startswith(root_name + ".") for n in covered) if root_name else bool(covered)
    if with_vocab and any(u.kind in ("attention", "mlp") for u in detector.units) and not ruled:
        detector.vocab()
    return detector.units, detector.refused
