"""Built-in tensor-parallel plans for the Hugging Face encoders that declare none.

``transformers`` declares no ``base_model_tp_plan`` for its masked-LM encoders, so their
blocks are recognized here by class name, as a table of :class:`BlockSpec` s:

=======================================  ==================================================
BERT-shaped (``Bert``, ``Roberta``,      ``<P>Attention``: ``self.query/key/value`` column,
``XLMRoberta``, ``Camembert``,           ``output.dense`` row; ``num_attention_heads`` and
``Electra``)                             ``all_head_size`` of ``self`` divided by tp;
                                         ``<P>Layer``: ``intermediate.dense`` column,
                                         ``output.dense`` row; ``<P>Embeddings.word_embeddings``
                                         vocab.
DistilBERT                               ``DistilBertSelfAttention``: ``q/k/v_lin`` column,
                                         ``out_lin`` row; ``FFN``: ``lin1`` column, ``lin2``
                                         row; ``Embeddings.word_embeddings`` vocab.
ALBERT (one layer shared by all depths)  ``AlbertAttention``: ``query/key/value`` column,
                                         ``dense`` row; ``AlbertLayer``: ``ffn`` column,
                                         ``ffn_output`` row; ``AlbertEmbeddings``
                                         ``word_embeddings`` vocab.
DeBERTa-v2/v3                            ``DebertaV2Attention``: ``self.query/key/value_proj``
                                         (and ``pos_key/pos_query_proj`` when present: the
                                         relative positions then use the local heads too)
                                         column, ``output.dense`` row; ``DebertaV2Layer`` as
                                         BERT's. Embeddings and MLM head stay whole: the new
                                         head multiplies by the embedding's weight itself.
ModernBERT                               ``ModernBertAttention``: ``Wqkv`` column over packed
                                         ``[q|k|v]``, ``Wo`` row; ``ModernBertMLP``: ``Wi``
                                         column over packed ``[input|gate]``, ``Wo`` row;
                                         ``tok_embeddings`` vocab, ``decoder`` vocab (tied).
=======================================  ==================================================

The masked-LM head is the model's ``get_output_embeddings()`` (``cls.predictions.decoder``,
``lm_head.decoder``, ``generator_lm_head``, ``vocab_projector``, ``predictions.decoder``):
a vocab head, tied to the vocab-sharded word embeddings when the model ties them. The heads'
forwards view projections with ``-1`` heads, so they run unchanged on the local heads;
attention dropout runs on the per-TP-rank RNG stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from torch import nn

from megastrategy.layers.unit_types import BuiltinUnit, SizeCheck, child, int_attr, is_hf_pretrained, is_linear_layer
from megastrategy.naming import join_name, parent_name

__all__ = ["BlockSpec", "ENCODER_SPECS", "encoder_units", "ENCODER_FAMILIES"]

#: class-name prefixes of the BERT-shaped families (their blocks mirror BERT's exactly)
_BERT_SHAPED = ("Bert", "Roberta", "XLMRoberta", "Camembert", "Electra")
#: class-name prefixes of every family here (their PreTrainedModels' output embeddings are heads)
ENCODER_FAMILIES = _BERT_SHAPED + ("DistilBert", "Albert", "ModernBert")


@dataclass(frozen=True)
class BlockSpec:
    """One recognized block: ``columns`` feed ``rows``; ``heads_owner`` (relative to the block)
    holds the head-count attributes and the attention dropout (``dropout_p``)."""

    arch: str
    cls: str
    kind: str
    columns: tuple[str, ...]
    rows: tuple[str, ...]
    heads_owner: str = ""
    divide_attrs: tuple[str, ...] = ()
    heads_attr: str | None = None
    dropout_p: str | None = None
    module_hint: str = ""  # a substring of the class's module, for generic class names
    optional_columns: tuple[str, ...] = ()  # column layers that exist only in some configs
    packed_chunks: int = 1  # equal chunks side by side in each column's output ([q|k|v], [in|gate])


def _bert_shaped(prefix: str) -> tuple[BlockSpec, ...]:
    arch = prefix.lower()
    return (
        BlockSpec(arch, f"{prefix}Attention", "attention", ("self.query", "self.key", "self.value"),
                  ("output.dense",), "self", ("num_attention_heads", "all_head_size"), "num_attention_heads",
                  "dropout.p"),
        BlockSpec(arch, f"{prefix}Layer", "mlp", ("intermediate.dense",), ("output.dense",), "intermediate"),
        BlockSpec(arch, f"{prefix}Embeddings", "embedding", ("word_embeddings",), ()),
    )


ENCODER_SPECS: tuple[BlockSpec, ...] = sum((_bert_shaped(p) for p in _BERT_SHAPED), ()) + (
    BlockSpec("distilbert", "DistilBertSelfAttention", "attention", ("q_lin", "k_lin", "v_lin"), ("out_lin",),
              "", ("n_heads",), "n_heads", "dropout.p"),
    BlockSpec("distilbert", "FFN", "mlp", ("lin1",), ("lin2",), module_hint="distilbert"),
    BlockSpec("distilbert", "Embeddings", "embedding", ("word_embeddings",), (), module_hint="distilbert"),
    BlockSpec("albert", "AlbertAttention", "attention", ("query", "key", "value"), ("dense",), "",
              ("num_attention_heads", "all_head_size"), "num_attention_heads", "attention_dropout.p"),
    BlockSpec("albert", "AlbertLayer", "mlp", ("ffn",), ("ffn_output",)),
    BlockSpec("albert", "AlbertEmbeddings", "embedding", ("word_embeddings",), ()),
    BlockSpec("debertav2", "DebertaV2Attention", "attention", ("self.query_proj", "self.key_proj", "self.value_proj"),
              ("output.dense",), "self", ("num_attention_heads", "all_head_size"), "num_attention_heads", "dropout.p",
              optional_columns=("self.pos_key_proj", "self.pos_query_proj")),
    BlockSpec("debertav2", "DebertaV2Layer", "mlp", ("intermediate.dense",), ("output.dense",), "intermediate"),
    BlockSpec("modernbert", "ModernBertAttention", "attention", ("Wqkv",), ("Wo",), "", (),
              "config.num_attention_heads", "attention_dropout", packed_chunks=3),
    BlockSpec("modernbert", "ModernBertMLP", "mlp", ("Wi",), ("Wo",), packed_chunks=2),
    BlockSpec("modernbert", "ModernBertEmbeddings", "embedding", ("tok_embeddings",), ()),
)
_BY_CLASS = {spec.cls: spec for spec in ENCODER_SPECS}


def _spec_unit(spec: BlockSpec, name: str, m: nn.Module) -> BuiltinUnit | None:
    if spec.kind == "embedding":
        if not isinstance(child(m, spec.columns[0]), nn.Embedding):
            return None
        return BuiltinUnit(spec.arch, "embedding", name, [(join_name(name, spec.columns[0]), "vocab", {})])
    if not all(is_linear_layer(child(m, p)) for p in spec.columns + spec.rows):
        return None
    owner = join_name(name, spec.heads_owner)
    owner_mod = child(m, spec.heads_owner) if spec.heads_owner else m
    heads = int_attr(owner_mod, spec.heads_attr) if spec.heads_attr else None
    columns = spec.columns + tuple(p for p in spec.optional_columns if is_linear_layer(child(m, p)))
    extra = {"packed_chunks": spec.packed_chunks} if spec.packed_chunks > 1 else {}
    members = [(join_name(name, p), "column", dict(extra)) for p in columns]
    members += [(join_name(name, p), "row", {}) for p in spec.rows]
    return BuiltinUnit(
        arch=spec.arch,
        kind=spec.kind,
        owner=owner,
        members=members,
        divide_attrs=spec.divide_attrs,
        checks=[SizeCheck(owner, spec.heads_attr, heads, "attention heads")] if heads else [],
        rng_region=(None, spec.dropout_p) if _has_dropout_p(owner_mod, spec.dropout_p) else None,
    )


def _has_dropout_p(owner: nn.Module, path: str | None) -> bool:
    """A dropout probability at ``path``: an ``nn.Dropout``'s ``p`` or a float attribute."""
    if path is None:
        return False
    parent = child(owner, path.rpartition(".")[0]) if "." in path else owner
    value = child(owner, path)
    return isinstance(parent, nn.Dropout) or (isinstance(value, float) and "." not in path)


def _output_head(name: str, m: nn.Module) -> BuiltinUnit | None:
    """The masked-LM head of an encoder model: its output embeddings, vocab-sharded."""
    family = next((p for p in ENCODER_FAMILIES if type(m).__name__.startswith(p)), None)
    get_out = getattr(m, "get_output_embeddings", None)
    head = get_out() if family and is_hf_pretrained(m) and callable(get_out) else None
    vocab = getattr(getattr(m, "config", None), "vocab_size", None)
    if not is_linear_layer(head) or getattr(head, "out_features", None) != vocab:
        return None  # not a vocabulary projection (e.g. a head that reads the embedding's weight)
    head_name = next((n for n, x in m.named_modules() if x is head), None)
    if not head_name:
        return None
    full = join_name(name, head_name)
    return BuiltinUnit(family.lower(), "lm_head", parent_name(full), [(full, "vocab", {})])


def _bert_shaped_by_structure(m: nn.Module) -> BlockSpec | None:
    """A block laid out as BERT's under another class name (ERNIE, RoFormer, LayoutLM, ESM, TAPAS,
    MegatronBERT, ...: the sweep found two dozen): the attention's ``self.query/key/value`` and
    ``output.dense`` linear with ``num_attention_heads``/``all_head_size`` on ``self``, or a layer's
    ``intermediate.dense`` and ``output.dense`` beside such an attention. Embeddings stay whole (a head
    tied to them may not be a vocab head). The block check verifies each against its original, so a
    clone whose forward also reads the full sizes elsewhere is refused, not trained wrong."""
    attn = ("self.query", "self.key", "self.value", "output.dense")
    if all(is_linear_layer(child(m, p)) for p in attn):
        own = child(m, "self")
        if _plain(own) and all(isinstance(int_attr(own, a), int) for a in ("num_attention_heads", "all_head_size")):
            return _bert_shaped(_prefix(m, "Attention"))[0]
    inner = getattr(m, "attention", None)
    if inner is not None and _bert_shaped_by_structure(inner) is not None and all(
            is_linear_layer(child(m, p)) for p in ("intermediate.dense", "output.dense")):
        return _bert_shaped(_prefix(m, "Layer"))[1]
    return None


def _plain(own: nn.Module) -> bool:
    """Only projections, dropout and parameter-free helpers (rotary tables): no per-head parameter of
    its own (Swin's relative position bias, ConvBERT's and Nystromformer's convolutions), which the
    rule would leave whole while the heads are split; structural detection handles those (Swin)."""
    if any(p is not None for p in own._parameters.values()):
        return False
    return all(isinstance(c, (nn.Linear, nn.Dropout, nn.Embedding)) or next(c.parameters(), None) is None
               for c in own.children())


def _prefix(m: nn.Module, suffix: str) -> str:
    name = type(m).__name__
    return name[: -len(suffix)] if name.endswith(suffix) and len(name) > len(suffix) else name


def encoder_units(name: str, m: nn.Module) -> Iterable[BuiltinUnit]:
    """The recognized encoder block ``m`` (named ``name``) as units."""
    spec = _BY_CLASS.get(type(m).__name__)
    if spec is None and type(m).__module__.startswith("transformers."):
        spec = _bert_shaped_by_structure(m)
    if spec is not None and spec.module_hint in type(m).__module__:
        unit = _spec_unit(spec, name, m)
        if unit is not None:
            yield unit
    head = _output_head(name, m)
    if head is not None:
        yield head
