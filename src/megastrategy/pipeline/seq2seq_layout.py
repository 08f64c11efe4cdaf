"""An encoder-decoder seen as one stack: the encoder's blocks, then the decoder's.

A Hugging Face encoder-decoder (T5, BART, Marian, mBART, Pegasus) holds two lists of blocks. The
pipeline cuts one stack, so the two are joined in call order: application ``g`` of the joined
stack is encoder block ``g`` for ``g < N`` and decoder block ``g - N`` after. The modules with
parameters beside the two lists are placed by where a dry run of the forward
(:mod:`.forward_order`, once per list) calls them:

- *pre*: before the first encoder block (the encoder's embeddings), on the first stage;
- *between*: after the last encoder block and before the first decoder block (the encoder's final
  norm, the decoder's embeddings), on the stage holding decoder block 0, the *seam* stage;
- *post*: after the last decoder block (the decoder's final norm, ``lm_head``), on the last stage.

The decoder's blocks also read the encoder's output (``encoder_hidden_states``, the *memory*)
through cross-attention, as a loop-invariant argument: it crosses every boundary after the seam
beside the decoder's hidden state (:mod:`.seq2seq_stage`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional
from torch import nn

from megastrategy.anatomy import OutsideModule, find_hf_model, get_submodule_path
from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.forward_order import ForwardOrder, record_forward_order

__all__ = ["MEMORY_ARGUMENT", "Seq2SeqLayout", "is_encoder_decoder", "seq2seq_layout"]

MEMORY_ARGUMENT = "encoder_hidden_states"  # what every Hugging Face decoder block calls the encoder's output


@dataclass(frozen=True)
class Seq2SeqLayout:
    """Where the two stacks are and what runs around them (see the module docstring)."""

    encoder_path: str
    decoder_path: str
    encoder_module_path: str  # the module whose output is the memory (``model.encoder``)
    num_encoder: int
    num_decoder: int
    pre: tuple[OutsideModule, ...]
    between: tuple[OutsideModule, ...]
    post: tuple[OutsideModule, ...]
    encoder_carried: tuple[tuple[int, str], ...]  # (output index, argument) encoder blocks hand the next
    decoder_carried: tuple[tuple[int, str], ...]
    encoder_arity: int
    decoder_arity: int
    orders: tuple[ForwardOrder, ForwardOrder]  # the dry runs with the encoder's, the decoder's blocks as the stack

    @property
    def num_blocks(self) -> int:
        return self.num_encoder + self.num_decoder

    def block(self, root: nn.Module, g: int) -> nn.Module:
        """Block ``g`` of the joined stack, in ``root`` as it is now."""
        if g < self.num_encoder:
            return get_submodule_path(root, self.encoder_path)[g]
        return get_submodule_path(root, self.decoder_path)[g - self.num_encoder]


def is_encoder_decoder(module: nn.Module) -> bool:
    """Whether ``module`` holds a Hugging Face encoder-decoder (``config.is_encoder_decoder``)."""
    hf = find_hf_model(module)[1]
    return bool(getattr(getattr(hf, "config", None), "is_encoder_decoder", False))


def seq2seq_layout(module: nn.Module, orders: Optional[tuple[ForwardOrder, ForwardOrder]] = None) -> Seq2SeqLayout:
    """The joined stack of the Hugging Face encoder-decoder in ``module``, or a clear refusal.

    ``orders``: the two dry runs' findings (:attr:`Seq2SeqLayout.orders`), kept from a first call on the module
    as the user built it; a second call after tensor parallelism rewrote modules then finds them
    as they are now without running the forward again."""
    hf_path, hf = find_hf_model(module)
    prefix = f"{hf_path}." if hf_path else ""
    encoder_path, decoder_path = (prefix + _blocks_of(hf, side) for side in ("encoder", "decoder"))
    encoder_module = prefix + next(name for name, m in hf.named_modules() if m is hf.get_encoder())
    orders = orders or tuple(record_forward_order(module, p) for p in (encoder_path, decoder_path))
    if any(o is None or o.reuses_blocks or o.block_arity is None for o in orders):
        raise MegatronConfigError(
            f"pp>1 with the encoder-decoder {type(hf).__name__}: its forward could not be dry-run on the meta device "
            "(or it applies a block twice), so where its modules run is unknown. Use pp=1 with tp, cp and data "
            "parallelism for it."
        )
    decoder = get_submodule_path(module, decoder_path)
    if MEMORY_ARGUMENT not in inspect.signature(decoder[0].forward).parameters:
        raise MegatronConfigError(
            f"pp>1 with {type(hf).__name__}: its decoder blocks take no {MEMORY_ARGUMENT!r} argument, so the "
            "encoder's output cannot be handed to decoder stages. Use pp=1 for it."
        )
    pre, between, post = _placed(module, encoder_path, decoder_path, *orders)
    enc, dec = orders
    return Seq2SeqLayout(encoder_path, decoder_path, encoder_module, len(get_submodule_path(module, encoder_path)), len(decoder),
                         tuple(pre), tuple(between), tuple(post), enc.carried, dec.carried, enc.block_arity,
                         dec.block_arity, (enc, dec))


def _blocks_of(hf: nn.Module, side: str) -> str:
    """The dotted path, from ``hf``, of the longest list of identical blocks in its encoder/decoder."""
    stack = hf.get_encoder() if side == "encoder" else hf.get_decoder()
    base = next(name for name, m in hf.named_modules() if m is stack)
    lists = [(n, m) for n, m in stack.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and len({type(b) for b in m}) == 1]
    if not lists:
        raise MegatronConfigError(f"pp>1 with {type(hf).__name__}: its {side} holds no nn.ModuleList of blocks.")
    name = max(lists, key=lambda item: len(item[1]))[0]
    return ".".join(p for p in (base, name) if p)


def _placed(root: nn.Module, encoder_path: str, decoder_path: str, enc: ForwardOrder, dec: ForwardOrder
            ) -> tuple[list[OutsideModule], list[OutsideModule], list[OutsideModule]]:
    """(pre, between, post): the parameter-holding subtrees beside the two stacks, by where the two
    dry runs saw them called; one the runs did not see (``shared``) goes by registration: before
    the encoder if registered before it, else after the decoder."""
    pre, between, post = [], [], []
    paths = (encoder_path.split("."), decoder_path.split("."))
    on_path = {".".join(p[:i]) for p in paths for i in range(1, len(p) + 1)}

    def walk(parent: nn.Module, prefix: str, seen_path: bool) -> None:
        for attr, child in parent._modules.items():
            name = f"{prefix}{attr}"
            if child is None:
                continue
            if name in on_path:
                if name not in (encoder_path, decoder_path):
                    walk(child, f"{name}.", seen_path)
                seen_path = True
                continue
            if not any(True for _ in child.parameters()):
                continue
            seen = enc.called.get(name, frozenset()) | dec.called.get(name, frozenset())
            outside = OutsideModule(name, parent, child, attr, by_registration=not seen)
            if not seen:
                (post if seen_path else pre).append(outside)
                continue
            for where, holds in ((pre, "before" in enc.called.get(name, ())),
                                 (between, "after" in enc.called.get(name, ()) and "before" in dec.called.get(name, ())),
                                 (post, "after" in dec.called.get(name, ()))):
                where.extend([outside] if holds else [])

    walk(root, "", False)
    return pre, between, post

