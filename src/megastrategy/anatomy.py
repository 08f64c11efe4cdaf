"""The model's anatomy, computed once: where the layer stack is, what runs before and after it,
and which parameters the two sides share (a tied embedding).

Tensor parallelism, sequence parallelism, recompute, pipeline cuts and CUDA graphs all reason
about the same stack of identical blocks. This module sits below ``layers/`` and ``pipeline/``
so every component can be handed one :class:`ModelAnatomy` instead of searching again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = [
    "ModelAnatomy", "OutsideModule", "find_hf_model", "find_layer_stack", "get_submodule_path", "outside_modules",
    "pp_plan_stack",
]


def get_submodule_path(module: nn.Module, path: str) -> nn.Module:
    """``module``'s submodule at dotted ``path`` (``pipeline_layers``), or an error saying what to give."""
    m = module
    for part in path.split("."):
        if not hasattr(m, part):
            raise MegatronConfigError(
                f"pipeline_layers={path!r}: {type(m).__name__} has no attribute {part!r}. "
                "Give the dotted path (from the LightningModule) of the nn.ModuleList that holds the blocks, "
                "e.g. 'model.bert.encoder.layer'."
            )
        m = getattr(m, part)
    return m


def find_hf_model(module: nn.Module) -> tuple[str, Optional[nn.Module]]:
    """The outermost Hugging Face ``PreTrainedModel`` inside ``module`` and its dotted path
    (``""`` for ``module`` itself), or ``("", None)``; found by type name so that transformers stays optional."""
    for name, m in module.named_modules():
        if any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__) and hasattr(m, "config"):
            return name, m
    return "", None


def pp_plan_stack(module: nn.Module) -> Optional[str]:
    """The layer stack named by the Hugging Face config's ``base_model_pp_plan``, or ``None``.

    The plan maps the base model's children, in forward order, to their (inputs, outputs); the one
    child that is an ``nn.ModuleList`` is the stack of blocks (``"layers"`` for Llama).
    """
    hf_path, hf = find_hf_model(module)
    if hf is None:
        return None
    found = _plan_stack(hf)
    if found is None:  # a multimodal model declares it on its text model (Voxtral, Qwen2-Audio)
        nested = {_plan_stack(m, name) for name, m in hf.named_modules() if name and _declares_pp_plan(m)} - {None}
        found = nested.pop() if len(nested) == 1 else None
    return ".".join(p for p in (hf_path, found) if p) if found is not None else None


def _declares_pp_plan(m: nn.Module) -> bool:
    return bool(getattr(getattr(m, "config", None), "base_model_pp_plan", None)) and hasattr(m, "base_model")


def _plan_stack(hf: nn.Module, prefix: str = "") -> Optional[str]:
    """The stack ``hf``'s own config's ``base_model_pp_plan`` names, as a path under ``prefix``."""
    plan = getattr(getattr(hf, "config", None), "base_model_pp_plan", None)
    if not plan:
        return None
    base = getattr(hf, "base_model", hf)
    base_path = next((name for name, m in hf.named_modules() if m is base), "")
    for child in plan:
        if isinstance(getattr(base, child, None), nn.ModuleList) and len(getattr(base, child)) > 0:
            return ".".join(p for p in (prefix, base_path, child) if p)
    return None


def find_layer_stack(module: nn.Module, pipeline_layers: Optional[str] = None) -> tuple[str, nn.ModuleList]:
    """The dotted path and the ``nn.ModuleList`` of blocks to split over pipeline stages.

    ``pipeline_layers`` wins; then the Hugging Face config's ``base_model_pp_plan``; then, in a
    multimodal model, its language model's blocks; then the longest ``ModuleList`` whose entries
    are all of one type; failing that (and with no list
    mixing kinds of blocks), the longest ``nn.Sequential`` of identical blocks (timm's ViT).
    """
    pipeline_layers = pipeline_layers or pp_plan_stack(module)
    if pipeline_layers is not None:
        stack = get_submodule_path(module, pipeline_layers)
        if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
            raise MegatronConfigError(
                f"pipeline_layers={pipeline_layers!r} is a {type(stack).__name__}, not an nn.ModuleList or nn.Sequential; "
                "point it at the list of transformer blocks (for example 'model.bert.encoder.layer')."
            )
        return pipeline_layers, stack
    best = _text_stack(module) or _longest_uniform(module, nn.ModuleList)
    if best is None and _mixed_stack_hint(module) is None:
        best = _longest_uniform(module, nn.Sequential)
    if best is None:
        raise MegatronConfigError(
            f"{type(module).__name__} has no nn.ModuleList of identical blocks to split over pipeline stages; "
            + (_mixed_stack_hint(module) or
               "keep the transformer blocks in an nn.ModuleList and pass its path as pipeline_layers='...'.")
        )
    return best


def _text_stack(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """In a multimodal Hugging Face model (its config holds a text sub-config), the blocks of the
    language model: the longest list of identical blocks in the nearest ancestor of the token
    embeddings that holds one. Gemma 3's vision tower has as many layers as its language model, or
    more (PaliGemma: 27 against 18), and the longest list anywhere would be the vision encoder's:
    stages would then cut a tower a text batch never runs, with the language model past the cut."""
    hf_path, hf = find_hf_model(module)
    get_text = getattr(getattr(hf, "config", None), "get_text_config", None)
    if hf is None or not callable(get_text) or get_text() is hf.config:
        return None
    try:
        embedding = hf.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    path = next((n for n, m in hf.named_modules() if m is embedding), None)
    while path:
        path = path.rpartition(".")[0]
        found = _longest_uniform(hf.get_submodule(path) if path else hf, nn.ModuleList)
        if found is not None:
            return ".".join(p for p in (hf_path, path, found[0]) if p), found[1]
    return None


def _longest_uniform(module: nn.Module, kind: type) -> Optional[tuple[str, nn.Module]]:
    """The longest ``kind`` container whose entries are all of one type. An ``nn.Sequential`` is
    only looked for when no ``nn.ModuleList`` holds blocks: timm keeps its blocks in one
    (``self.blocks(x)``), but small MLPs are one too, so it must hold at least two blocks that
    are themselves containers (not bare layers)."""
    best: Optional[tuple[str, nn.Module]] = None
    for name, m in module.named_modules():
        if not isinstance(m, kind) or len(m) == 0 or len({type(b) for b in m}) != 1:
            continue
        if kind is nn.Sequential and (type(m) is not nn.Sequential or len(m) < 2 or not any(True for _ in m[0].children())):
            continue
        if best is None or len(m) > len(best[1]):
            best = (name, m)
    return best


def _mixed_stack_hint(module: nn.Module) -> Optional[str]:
    """The fix when the longest list of blocks mixes kinds (Jamba's Mamba and attention layers):
    it is only found on request, since which list holds the blocks is then a guess."""
    lists = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return None
    name, stack = max(lists, key=lambda item: len(item[1]))
    kinds = ", ".join(dict.fromkeys(type(b).__name__ for b in stack))
    return (f"the longest list, {name!r}, mixes {kinds}. If those are the blocks, pass pipeline_layers={name!r} "
            "(stages then hold different kinds of blocks, which is exact); otherwise keep the transformer blocks in "
            "an nn.ModuleList and pass its path as pipeline_layers='...'.")


@dataclass(frozen=True)
class OutsideModule:
    """A maximal subtree with parameters beside the stack (run before or after it)."""

    name: str
    parent: nn.Module
    module: nn.Module
    attr: str
    by_registration: bool = False  # placed by where it is registered: no dry run of the forward saw it


def outside_modules(
    root: nn.Module, stack_path: str, called: Optional[Mapping[str, frozenset[str]]] = None
) -> tuple[list[OutsideModule], list[OutsideModule]]:
    """(pre, post): the parameter-holding subtrees that run before/after the stack.

    ``called`` (from a dry run of the forward, :mod:`megastrategy.pipeline.forward_order`) maps a
    subtree's name to where the forward called it: ``{"before"}``, ``{"after"}`` or both (then it
    is in both lists, and its parameters are tied between the first and last stage). Subtrees the
    dry run did not see fall back to registration order: registered before the stack runs before it.
    Parameter-free modules (dropout, rotary tables) are in neither list: they run everywhere.
    """
    called = called or {}
    pre: list[OutsideModule] = []
    post: list[OutsideModule] = []
    parent, prefix = root, ""
    for part in stack_path.split("."):
        seen_path_child = False
        for attr, child in parent._modules.items():
            if child is None:
                continue
            if attr == part:
                seen_path_child = True
                continue
            if any(True for _ in child.parameters()):
                name = f"{prefix}{attr}"
                where = called.get(name) or {"after" if seen_path_child else "before"}
                outside = OutsideModule(name, parent, child, attr, by_registration=name not in called)
                pre += [outside] if "before" in where else []
                post += [outside] if "after" in where else []
        parent, prefix = getattr(parent, part), f"{prefix}{part}."
    return pre, post


@dataclass
class ModelAnatomy:
    """The layer stack, the modules before/after it, and their shared (tied) parameters."""

    stack_path: str
    stack: nn.ModuleList
    pre: list[OutsideModule]
    post: list[OutsideModule]
    tied_parameters: list[nn.Parameter]

    @classmethod
    def of(
        cls, module: nn.Module, pipeline_layers: Optional[str] = None, called: Optional[Mapping[str, frozenset[str]]] = None
    ) -> "ModelAnatomy":
        """``called``: where the forward calls each outside subtree (see :func:`outside_modules`)."""
        path, stack = find_layer_stack(module, pipeline_layers)
        pre, post = outside_modules(module, path, called)
        pre_params = {id(p) for o in pre for p in o.module.parameters()}
        tied = [p for o in post for p in o.module.parameters() if id(p) in pre_params]
        return cls(stack_path=path, stack=stack, pre=pre, post=post, tied_parameters=tied)

    @classmethod
    def find(cls, module: nn.Module, pipeline_layers: Optional[str] = None) -> Optional["ModelAnatomy"]:
        """The anatomy, or ``None`` for a model without a stack of identical blocks (fine at pp=1)."""
        try:
            return cls.of(module, pipeline_layers)
        except MegatronConfigError:
            if pipeline_layers is not None:
                raise
            return None
