"""Built-in tensor-parallel plans: which layers of a known architecture are sharded, and how.

Detection walks ``module.named_modules()`` and recognizes building blocks **by class**,
wherever they sit in the user's module (a LightningModule holding a Hugging Face model,
a model inside a wrapper, ...). Every recognized block becomes a :class:`BuiltinUnit`: the
layers that must be sharded *together* for the block's unchanged ``forward`` to stay
correct (a column-parallel projection and the row-parallel layer that consumes its output),
the attributes of the block that count local heads and must be divided by ``tp``, the
sizes that ``tp`` must divide, and where attention dropout runs on TP-sharded heads.

Known blocks (``transformers`` 5.x, ``torch.nn``):

===================================  ==========================================================
Hugging Face encoders                BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA, DistilBERT,
                                     ALBERT, DeBERTa-v2, ModernBERT:
                                     :mod:`megastrategy.layers.encoder_plans`.
Hugging Face GPT-2                   ``GPT2Attention``: ``c_attn`` column over a packed
                                     ``[q|k|v]`` (``packed_chunks=3``; cross-attention:
                                     ``q_attn`` column and ``c_attn`` packed ``[k|v]``),
                                     ``c_proj`` row; fix-ups ``num_heads``, ``split_size``
                                     (the forward splits ``c_attn``'s output by
                                     ``split_size``; ``embed_dim`` is not read by the forward
                                     and is left alone); per-TP-rank RNG from the start of
                                     the forward until ``c_proj`` (``resid_dropout`` acts on
                                     the replicated output and stays on the default stream).
                                     ``GPT2MLP``: ``c_fc`` column, ``c_proj`` row.
                                     ``GPT2Model.wte`` vocab; ``lm_head`` vocab (tied).
Hugging Face Llama family (only     ``{Llama,Mistral,Qwen2,Qwen3,StableLm}Attention``: ``q/k/v_proj``
where the model declares no plan)   column, ``o_proj`` row (no head-count attribute exists
                                     in the 5.x code: heads come from ``view(..., -1,
                                     head_dim)``; ``num_heads``/``num_key_value_heads`` are
                                     divided if an older version defines them). ``...MLP``:
                                     ``gate_proj``/``up_proj`` column, ``down_proj`` row.
                                     ``...Model.embed_tokens`` vocab, ``...ForCausalLM.lm_head``
                                     vocab (tied or not).
``torch.nn``                         any ``nn.MultiheadAttention`` -> ``attention`` (replaced by
                                     ``TensorParallelMultiheadAttention.from_module``);
                                     ``TransformerEncoderLayer``/``TransformerDecoderLayer``:
                                     ``linear1`` column, ``dropout`` (between the two FFN
                                     layers, on sharded activations) -> ``dropout``
                                     (``TensorParallelRegionDropout``), ``linear2`` row.
===================================  ==========================================================

Other ``nn.Linear``/``Conv1D`` layers of a recognized Hugging Face model (poolers,
classifiers, the MLM transform) are small and stay replicated.

Sources, most trusted first: a Hugging Face model's own declared plan
(:mod:`megastrategy.layers.hf_declared`) is used for everything inside that model; the class
rules here apply elsewhere; in a Hugging Face model that declares nothing, the layers no class
rule names are left to structural detection (:mod:`megastrategy.layers.structural_plans`); so is
the layer stack of a user's own model (:mod:`megastrategy.layers.user_stack_plans`). This module is pure: it reads modules and never changes them.
"""
from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from megastrategy.layers.encoder_plans import encoder_units
from megastrategy.layers.hf_declared import declared_plan
from megastrategy.layers.litgpt_plans import litgpt_units
from megastrategy.layers.structural_plans import structural_units
from megastrategy.layers.timm_plans import timm_units
from megastrategy.layers.user_stack_plans import user_stack_units
from megastrategy.layers.unit_types import (
    HEAD_ATTRS,
    BuiltinDetection,
    BuiltinUnit,
    Refusal,
    SizeCheck,
    int_attr,
    is_conv1d,
    is_hf_pretrained,
    is_linear_layer,
)
from megastrategy.naming import join_name

__all__ = [
    "HEAD_ATTRS",
    "SizeCheck",
    "BuiltinUnit",
    "BuiltinDetection",
    "detect_builtin_plan",
    "is_conv1d",
    "is_hf_pretrained",
    "KNOWN_ARCHITECTURES",
]

#: human-readable list used in error messages
KNOWN_ARCHITECTURES = (
    "Hugging Face models declaring base_model_tp_plan (Llama, Qwen3, Gemma, Phi3, OLMo2, GPT-NeoX, ...)",
    "BERT/RoBERTa/XLM-R/CamemBERT/ELECTRA/DistilBERT/ALBERT",
    "GPT-2 (GPT2*)",
    "Llama/Mistral/Qwen2/Qwen3/StableLM",
    "torch.nn.TransformerEncoderLayer/TransformerDecoderLayer",
    "torch.nn.MultiheadAttention",
    "LitGPT (litgpt.model.GPT; tp must divide n_query_groups or be a multiple of it)",
    "timm Vision Transformer blocks (Attention, Mlp)",
)

_LLAMA_FAMILY = ("Llama", "Mistral", "Qwen2", "Qwen3", "StableLm")


def _gpt2(name: str, m: nn.Module) -> Iterable[BuiltinUnit]:
    cls = type(m).__name__
    if cls == "GPT2Attention":
        if not (is_linear_layer(getattr(m, "c_attn", None)) and is_linear_layer(getattr(m, "c_proj", None))):
            return
        if getattr(m, "is_cross_attention", False):
            if not is_linear_layer(getattr(m, "q_attn", None)):
                return
            members = [
                (join_name(name, "q_attn"), "column", {}),
                (join_name(name, "c_attn"), "column", {"packed_chunks": 2}),
            ]
        else:
            members = [(join_name(name, "c_attn"), "column", {"packed_chunks": 3})]
        members.append((join_name(name, "c_proj"), "row", {}))
        heads = int_attr(m, "num_heads")
        yield BuiltinUnit(
            arch="gpt2",
            kind="attention",
            owner=name,
            members=members,
            divide_attrs=("num_heads", "split_size"),
            checks=[SizeCheck(name, "num_heads", heads, "attention heads")] if heads else [],
            rng_region=(join_name(name, "c_proj"), "attn_dropout.p")
            if isinstance(getattr(m, "attn_dropout", None), nn.Dropout)
            else None,
        )
    elif cls == "GPT2MLP":
        if is_linear_layer(getattr(m, "c_fc", None)) and is_linear_layer(getattr(m, "c_proj", None)):
            yield BuiltinUnit(
                "gpt2", "mlp", name, [(join_name(name, "c_fc"), "column", {}), (join_name(name, "c_proj"), "row", {})]
            )
    elif cls == "GPT2Model":
        if isinstance(getattr(m, "wte", None), nn.Embedding):
            yield BuiltinUnit("gpt2", "embedding", name, [(join_name(name, "wte"), "vocab", {})])
    elif cls in ("GPT2LMHeadModel", "GPT2DoubleHeadsModel"):
        if is_linear_layer(getattr(m, "lm_head", None)):
            yield BuiltinUnit("gpt2", "lm_head", name, [(join_name(name, "lm_head"), "vocab", {})])


# -- Hugging Face Llama family ---------------------------------------------------------------
def _llama(name: str, m: nn.Module) -> Iterable[BuiltinUnit]:
    cls = type(m).__name__
    prefix = next((p for p in _LLAMA_FAMILY if cls.startswith(p)), None)
    if prefix is None:
        return
    suffix = cls[len(prefix):]
    arch = prefix.lower()
    if suffix == "Attention":
        projs = ("q_proj", "k_proj", "v_proj", "o_proj")
        if not all(is_linear_layer(getattr(m, p, None)) for p in projs):
            return
        config = getattr(m, "config", None)
        checks = []
        for attr in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                checks.append(SizeCheck(name, f"config.{attr}", value, "attention heads"))
        yield BuiltinUnit(
            arch=arch,
            kind="attention",
            owner=name,
            members=[
                (join_name(name, "q_proj"), "column", {}),
                (join_name(name, "k_proj"), "column", {}),
                (join_name(name, "v_proj"), "column", {}),
                (join_name(name, "o_proj"), "row", {}),
            ],
            divide_attrs=("num_heads", "num_key_value_heads"),
            checks=checks,
            rng_region=(None, "attention_dropout") if hasattr(m, "attention_dropout") else None,
        )
    elif suffix == "MLP":
        if all(is_linear_layer(getattr(m, p, None)) for p in ("gate_proj", "up_proj", "down_proj")):
            yield BuiltinUnit(
                arch,
                "mlp",
                name,
                [
                    (join_name(name, "gate_proj"), "column", {}),
                    (join_name(name, "up_proj"), "column", {}),
                    (join_name(name, "down_proj"), "row", {}),
                ],
            )
    elif suffix == "Model":
        if isinstance(getattr(m, "embed_tokens", None), nn.Embedding):
            yield BuiltinUnit(arch, "embedding", name, [(join_name(name, "embed_tokens"), "vocab", {})])
    elif suffix == "ForCausalLM":
        if is_linear_layer(getattr(m, "lm_head", None)):
            yield BuiltinUnit(arch, "lm_head", name, [(join_name(name, "lm_head"), "vocab", {})])


# -- torch.nn --------------------------------------------------------------------------------
def _torch(name: str, m: nn.Module) -> Iterable[BuiltinUnit]:
    if isinstance(m, nn.MultiheadAttention):
        yield BuiltinUnit(
            arch="torch",
            kind="attention",
            owner=name,
            members=[(name, "attention", {})],
            checks=[SizeCheck(name, "num_heads", int(m.num_heads), "attention heads")],
        )
    elif isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        if not (isinstance(getattr(m, "linear1", None), nn.Linear) and isinstance(getattr(m, "linear2", None), nn.Linear)):
            return
        members: list[tuple[str, str, dict[str, Any]]] = [(join_name(name, "linear1"), "column", {})]
        if isinstance(getattr(m, "dropout", None), nn.Dropout):
            members.append((join_name(name, "dropout"), "dropout", {}))
        members.append((join_name(name, "linear2"), "row", {}))
        yield BuiltinUnit(arch="torch", kind="mlp", owner=name, members=members)


_DETECTORS = (encoder_units, _gpt2, _llama, _torch, timm_units)


def _inside(name: str, roots: dict[str, str]) -> bool:
    return any(r == "" or name == r or name.startswith(r + ".") for r in roots)


def detect_builtin_plan(module: nn.Module, user_stacks: bool = True) -> BuiltinDetection:
    """Recognize known blocks in ``module`` (names relative to it); pure. Inside a Hugging Face
    model that declares a tensor-parallel plan, that declaration is used instead of the rules.
    ``user_stacks=False`` leaves a user's own layer stack alone (no trace)."""
    declared = declared_plan(module)
    units: list[BuiltinUnit] = list(declared.units)
    roots: dict[str, str] = dict(declared.roots)
    for name, m in module.named_modules():
        if _inside(name, declared.roots):
            continue
        for detector in _DETECTORS:
            units.extend(detector(name, m))
    refused = list(declared.refused)
    for name, m in module.named_modules():
        for found in litgpt_units(name, m):
            (refused if isinstance(found, Refusal) else units).append(found)
    for name, m in _undeclared_hf_models(module, declared.roots):
        covered = {member for u in units for member, _, _ in u.members}
        found, refusals = structural_units(name, m, covered)
        units.extend(found)
        refused.extend(refusals)
    if user_stacks:
        found, refusals = user_stack_units(module, {member for u in units for member, _, _ in u.members})
        units.extend(found)
        refused.extend(refusals)
    # Hugging Face models that contain at least one recognized block
    for name, m in module.named_modules():
        if not is_hf_pretrained(m) or name in roots:
            continue
        prefix = name + "." if name else ""
        archs = [u.arch for u in units if u.arch != "torch" and (u.owner == name or u.owner.startswith(prefix))]
        if archs:
            roots[name] = archs[0]
    return BuiltinDetection(units=units, recognized_roots=roots, refused=refused)


def _undeclared_hf_models(module: nn.Module, declared_roots: dict[str, str]) -> list[tuple[str, nn.Module]]:
    """Outermost Hugging Face models without a declared plan: structural detection's ground."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in module.named_modules():
        if is_hf_pretrained(m) and not _inside(name, declared_roots) and not _inside(name, dict(found)):
            found.append((name, m))
    return found
