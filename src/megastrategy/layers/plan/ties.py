"""The ties pass: a Parameter shared between modules survives sharding only as a vocab head
tied to its vocab embedding, or as a head bias aliased on the head's parent (Hugging Face
BERT's ``predictions.bias``); every other tie of a sharded layer is an error."""
from __future__ import annotations

from collections import defaultdict

from torch import nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan.drafts import DraftEntry, Drafts
from megastrategy.layers.plan.module_names import is_inside
from megastrategy.layers.plan.rules import SHARDED_STYLES
from megastrategy.naming import parent_name

__all__ = ["resolve_ties"]

#: another holder of a Parameter: (canonical module name, attribute, full parameter name)
_Holder = tuple[str, str, str]


class _ParameterHolders:
    """Every name under which each Parameter is reachable, with its holding module."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.all_modules = dict(module.named_modules(remove_duplicate=False))
        self.canonical = {id(m): n for n, m in module.named_modules()}
        self.holders: dict[int, list[str]] = defaultdict(list)
        for pn, p in module.named_parameters(remove_duplicate=False):
            self.holders[id(p)].append(pn)

    def others(self, name: str, m: nn.Module, p: nn.Parameter) -> list[_Holder]:
        """Holders of ``p`` outside module ``name`` (``m``)."""
        found = []
        for pn in self.holders[id(p)]:
            mod_name, _, attr = pn.rpartition(".")
            mod = self.all_modules[mod_name] if mod_name else self.module
            cname = self.canonical.get(id(mod), mod_name)
            if mod is m or cname == name or is_inside(cname, name):
                continue
            found.append((cname, attr, pn))
        return found


def resolve_ties(module: nn.Module, modules: dict[str, nn.Module], drafts: Drafts) -> None:
    """Record vocab-head/embedding ties and BERT-style bias aliases; reject other ties."""
    holders = _ParameterHolders(module)
    vocab_emb = {n for n, d in drafts.items() if d.style == "vocab" and isinstance(modules[n], nn.Embedding)}
    vocab_head = {n for n, d in drafts.items() if d.style == "vocab" and n not in vocab_emb}
    for n, d in drafts.items():
        if d.style not in SHARDED_STYLES:
            continue
        for local, p in modules[n].named_parameters():
            others = holders.others(n, modules[n], p)
            if not others:
                continue
            if n in vocab_head and local == "weight":
                _tie_head_weight(n, d, others, vocab_emb)
            elif n in vocab_head and local == "bias":
                _alias_head_bias(n, d, others)
            elif n in vocab_emb and local == "weight":
                _check_embedding_weight(n, others, vocab_head)
            else:
                _raise_other_tie(n, d, local, others)


def _tie_head_weight(n: str, d: DraftEntry, others: list[_Holder], vocab_emb: set[str]) -> None:
    embs = {c for c, a, _ in others if c in vocab_emb and a == "weight"}
    rest = [pn for c, a, pn in others if not (c in vocab_emb and a == "weight")]
    if len(embs) == 1 and not rest:
        d.tied_to = next(iter(embs))
        return
    emb_names = [c for c, a, _ in others]
    raise MegatronConfigError(
        f"{n}.weight (a 'vocab' head) is tied to {', '.join(repr(x) for x in emb_names)}, which "
        f"{'is' if len(emb_names) == 1 else 'are'} not a vocab-sharded nn.Embedding; a tied head "
        f"and its embedding must both be 'vocab': add {{{emb_names[0]!r}: 'vocab'}} to tp_plan "
        f"(or mark both 'replicate')."
    )


def _alias_head_bias(n: str, d: DraftEntry, others: list[_Holder]) -> None:
    parent = parent_name(n)
    aliases = [a for c, a, _ in others if c == parent]
    rest = [pn for c, a, pn in others if c != parent]
    if not rest:
        d.bias_aliases = tuple(aliases)
        return
    raise MegatronConfigError(
        f"{n}.bias (a 'vocab' head) is shared with {', '.join(rest)}; only an alias on the head's "
        f"parent module (as in Hugging Face BERT's `predictions.bias`) can follow the sharding. "
        f"Untie it or mark {n!r} 'replicate'."
    )


def _check_embedding_weight(n: str, others: list[_Holder], vocab_head: set[str]) -> None:
    """The head's side records the tie; the embedding only checks nothing else shares it."""
    bad = [pn for c, a, pn in others if not (c in vocab_head and a == "weight")]
    if not bad:
        return
    raise MegatronConfigError(
        f"{n}.weight (a 'vocab' embedding) is tied to {', '.join(bad)}, which is not a 'vocab' head; "
        f"a weight shared with the embedding must be sharded the same way: mark "
        f"{bad[0].rpartition('.')[0]!r} 'vocab' in tp_plan (or mark both 'replicate')."
    )


def _raise_other_tie(n: str, d: DraftEntry, local: str, others: list[_Holder]) -> None:
    shared = ", ".join(pn for _, _, pn in others)
    raise MegatronConfigError(
        f"{n}.{local} ({d.style!r}) is the same Parameter as {shared}; only a vocab head tied to its "
        f"vocab embedding can stay tied under tensor parallelism. Untie the parameters, or mark "
        f"{n!r} and the module holding {others[0][2]!r} 'replicate' in tp_plan."
    )
