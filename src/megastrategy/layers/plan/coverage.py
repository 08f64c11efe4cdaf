"""The coverage passes: under auto-detection nothing important may stay silently replicated,
some layer must be sharded at all, and the layers left alone are listed (for the table)."""
from __future__ import annotations

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.builtin_plans import KNOWN_ARCHITECTURES, BuiltinDetection
from megastrategy.layers.hf_declared import TRANSLATED_STYLES
from megastrategy.layers.plan.context import PlanContext
from megastrategy.layers.plan.drafts import DraftEntry, Drafts
from megastrategy.layers.plan.layer_kinds import is_linear, is_weight_layer, type_name
from megastrategy.layers.plan.match import Effective
from megastrategy.layers.plan.module_names import globify, is_inside
from megastrategy.layers.plan.rules import AUTO
from megastrategy.naming import parent_name

__all__ = ["check_coverage", "add_known_replicated", "drop_inside_attention"]


def check_coverage(ctx: PlanContext, effective: dict[str, Effective], drafts: Drafts) -> None:
    """At ``tp > 1``: no unclassifiable layer in a repeated block (auto-detection), and
    something to shard."""
    if ctx.auto_mode and ctx.tp_size > 1:
        _check_refused(ctx, effective)
        _check_unclassified(ctx, effective, drafts)
    if ctx.tp_size > 1 and not any(d.style != "replicate" for d in drafts.values()):
        _raise_nothing_to_shard(ctx)


def _attention_names(drafts: Drafts) -> list[str]:
    return [n for n, d in drafts.items() if d.style == "attention"]


def _auto_style(effective: dict[str, Effective], name: str) -> bool:
    return name in effective and effective[name].style == AUTO


def _recognized_root(name: str, detection: BuiltinDetection) -> str | None:
    best = None
    for root in detection.recognized_roots:
        if root == "" or is_inside(name, root):
            if best is None or len(root) > len(best):
                best = root
    return best


def _in_repeated_block(name: str, modules: dict[str, nn.Module], root: nn.Module) -> bool:
    """Is ``name`` strictly inside an element of an ``nn.ModuleList``/``nn.Sequential``?"""
    parts = name.split(".")
    for i in range(len(parts) - 1):  # element = parts[: i+1], must not be the layer itself
        container_name = ".".join(parts[:i])
        container = modules.get(container_name) if container_name else root
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and parts[i].isdigit():
            return True
    return False


def _unclassified(ctx: PlanContext, effective: dict[str, Effective], drafts: Drafts) -> list[str]:
    """Linear layers auto-detection left alone inside repeated blocks it did not recognize."""
    replaced_whole = _attention_names(drafts) + [
        n for n in ctx.names if isinstance(ctx.modules[n], (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
    ]
    found = []
    for n in ctx.names:
        if not is_linear(ctx.modules[n]) or n in drafts or not _auto_style(effective, n):
            continue
        if _recognized_root(n, ctx.detection) is not None:
            continue
        if any(is_inside(n, a) for a in replaced_whole):
            continue
        if _in_repeated_block(n, ctx.modules, ctx.module):
            found.append(n)
    return found


def _check_unclassified(ctx: PlanContext, effective: dict[str, Effective], drafts: Drafts) -> None:
    unclassified = _unclassified(ctx, effective, drafts)
    if not unclassified:
        return
    globs = list(dict.fromkeys(globify(n) for n in unclassified))
    blocks = list(dict.fromkeys(globify(parent_name(n)) for n in unclassified))
    example = ", ".join(f"{g!r}: '<column|row|replicate>'" for g in globs[:8])
    more = f" (and {len(globs) - 8} more)" if len(globs) > 8 else ""
    mode = "tp_plan=None" if ctx.tp_plan is None else "an 'auto' entry in tp_plan"
    found = (
        f"it recognized {', '.join(ctx.detection.architectures)} blocks but"
        if ctx.detection.units
        else "it recognized no known block and"
    )
    raise MegatronConfigError(
        f"tp={ctx.tp_size} with auto-detection ({mode}): "
        f"{found} cannot classify the linear layers "
        f"{', '.join(repr(g) for g in globs[:8])}{more} inside repeated block(s) "
        f"{', '.join(repr(b) for b in blocks[:4])}; replicating them would leave the bulk of the model "
        f"unsharded. Name them in tp_plan and keep auto-detection for the rest, e.g. "
        f"tp_plan={{'*': 'auto', {example}}} -- 'column' for layers whose output is split (q/k/v, the "
        f"first FFN layer), 'row' for the layer consuming a split input (attention output projection, "
        f"second FFN layer), 'replicate' to keep a layer whole."
    )


def _check_refused(ctx: PlanContext, effective: dict[str, Effective]) -> None:
    """A declared style with no exact translation, on a module left to auto-detection."""
    for r in ctx.detection.refused:
        module = r.module if r.module in ctx.modules else parent_name(r.module)
        if not _auto_style(effective, module):
            continue
        glob = globify(module)
        if r.origin == "builtin":
            raise MegatronConfigError(
                f"tp={ctx.tp_size} with auto-detection: {r.module!r} is a {r.style}, and {r.reason}. {r.advice}"
            )
        if r.advice:
            raise MegatronConfigError(
                f"tp={ctx.tp_size} with auto-detection: Hugging Face declares tensor-parallel style {r.style!r} for "
                f"{r.module!r}, and {r.reason}. {r.advice}"
            )
        if r.origin == "structural":
            raise MegatronConfigError(
                f"tp={ctx.tp_size} with auto-detection: {r.module!r} declares no tensor-parallel plan and "
                f"{r.reason}; refusing rather than guessing. Name its layers in tp_plan, e.g. "
                f"tp_plan={{'*': 'auto', {glob!r}: 'replicate'}} to keep it whole on every rank, or use tp=1."
            )
        raise MegatronConfigError(
            f"tp={ctx.tp_size} with auto-detection: Hugging Face declares tensor-parallel style {r.style!r} for "
            f"{r.module!r}, and {r.reason}; this strategy translates only styles it reproduces exactly "
            f"({', '.join(TRANSLATED_STYLES)}). Decide for this module in tp_plan, e.g. "
            f"tp_plan={{'*': 'auto', {glob!r}: 'replicate'}} to keep it whole on every rank, or use tp=1."
        )


def _raise_nothing_to_shard(ctx: PlanContext) -> None:
    modules, tp_plan, tp_size = ctx.modules, ctx.tp_plan, ctx.tp_size
    linears = [n for n in ctx.names if is_linear(modules[n]) or isinstance(modules[n], nn.Embedding)]
    globs = list(dict.fromkeys(globify(n) for n in linears))
    example = ", ".join(f"{g!r}: '<column|row|vocab|replicate>'" for g in globs[:6])
    if tp_plan is None:
        raise MegatronConfigError(
            f"tp={tp_size} with tp_plan=None: auto-detection found nothing to shard in "
            f"{type_name(ctx.module)} (known: {'; '.join(KNOWN_ARCHITECTURES)}). Pass tp_plan naming the layers "
            f"to shard, e.g. tp_plan={{'blocks.*.attn.q': 'column', 'blocks.*.attn.k': 'column', "
            f"'blocks.*.attn.v': 'column', 'blocks.*.attn.proj': 'row', 'blocks.*.mlp.fc1': 'column', "
            f"'blocks.*.mlp.fc2': 'row', 'wte': 'vocab'}}; this model's layers: "
            f"{{{example}}}" + (" ..." if len(globs) > 6 else "")
        )
    raise MegatronConfigError(
        f"tp={tp_size} with tp_plan={dict(tp_plan)!r}: the plan shards nothing (every layer it names is "
        f"'replicate' or unrecognized under 'auto'); give some nn.Linear layers 'column'/'row' "
        f"(or nn.Embedding 'vocab'), e.g. {{{example}}}, or use tp=1."
    )


def add_known_replicated(ctx: PlanContext, effective: dict[str, Effective], drafts: Drafts) -> None:
    """A ``replicate`` entry for every other weight layer (outside sharded attention), with
    where that decision came from."""
    attention = _attention_names(drafts)
    for n in ctx.names:
        if n in drafts or not is_weight_layer(ctx.modules[n]):
            continue
        if any(is_inside(n, a) for a in attention):
            continue
        root = _recognized_root(n, ctx.detection)
        if not _auto_style(effective, n):
            source = "default"
        elif root is not None:
            source = f"auto:{ctx.detection.recognized_roots[root]}"
        else:
            source = "auto"
        drafts[n] = DraftEntry("replicate", source)


def drop_inside_attention(drafts: Drafts) -> None:
    """An ``nn.MultiheadAttention`` is replaced as a whole: a user rule may not shard inside it,
    and what lies inside it has no entry of its own."""
    attention = _attention_names(drafts)
    for n in list(drafts):
        for a in attention:
            if is_inside(n, a) and drafts[n].style != "replicate":
                raise MegatronConfigError(
                    f"tp_plan: {n!r} lies inside {a!r}, an nn.MultiheadAttention that is sharded as a whole "
                    f"(by heads); drop the entry for {n!r} or mark {a!r} 'replicate'."
                )
            if is_inside(n, a):
                drafts.pop(n)
                break
