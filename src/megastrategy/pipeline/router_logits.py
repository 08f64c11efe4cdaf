"""A Hugging Face MoE model's router logits carried across pipeline stages, so that its
load-balancing loss under ``pp > 1`` is the one device's.

With ``config.output_router_logits=True`` a Hugging Face MoE causal LM (Mixtral, Qwen3-MoE,
OLMoE, ... in transformers 5.x) adds ``router_aux_loss_coef * load_balancing_loss_func(router
logits of every layer)`` to its loss, after the stack. The logits are recorded by forward hooks on
the routers into a collector that ``capture_outputs`` (the decorator of the inner model's forward)
holds while the forward runs. Under pp the last stage's forward only sees its own layers' routers.

So each stage boundary carries, beside the hidden state (:mod:`.boundary_pack`), every router
logit recorded so far in this microbatch's forward, stacked in layer order, and the next stage
puts them at the front of its collector before its first block runs: the last stage's loss is
computed from every layer's logits in order. Packing is differentiable, so the aux loss's gradient
flows back to the earlier stages' routers with the hidden state's.

Exact only per microbatch: the loss is a product of two batch-wide statistics (the fraction of
tokens each expert receives, the mean router probability), so with ``num_microbatches > 1`` each
microbatch's loss is not the batch's and their mean differs from one device. That case is refused
(:func:`refuse_router_logits`), as are models that record router logits another way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megastrategy.errors import MegatronConfigError

__all__ = ["RouterLogitsCarry", "carry_for", "records_router_logits", "recorded_router_logits", "refuse_router_logits",
           "stacked_router_logits", "prepend_router_logits", "wants_router_logits", "map_recorded_router_logits"]

KEY = "router_logits"


def _collector():
    """transformers' active output collector (a context variable), or ``None`` without one."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # transformers < 5: no hook-recorded outputs
        return None
    return _active_collector


def records_router_logits(hf: Optional[nn.Module]) -> bool:
    """Whether ``hf`` (a Hugging Face model) records router logits through transformers'
    output hooks, in some model of its tree (the inner ``MixtralModel`` holds the registry entry)."""
    if hf is None or _collector() is None:
        return False
    return any(KEY in (getattr(m, "_can_record_outputs", None) or {}) for m in hf.modules())


def wants_router_logits(hf: Optional[nn.Module]) -> bool:
    """Whether the model's config asks for the load-balancing loss (and so for the logits)."""
    return bool(getattr(getattr(hf, "config", None), "output_router_logits", False))


def refuse_router_logits(hf: Optional[nn.Module], pp: int, num_microbatches: int, encoder_decoder: bool) -> None:
    """Refuse ``output_router_logits=True`` where carrying the logits cannot make the loss exact."""
    if not wants_router_logits(hf):
        return
    name = type(hf).__name__
    keep_off = "Set config.output_router_logits=False (training without that loss), or use pp=1."
    if encoder_decoder or not records_router_logits(hf):
        how = "an encoder-decoder" if encoder_decoder else "a model that does not record them through transformers' output hooks"
        raise MegatronConfigError(
            f"pp={pp} with {name} and output_router_logits=True: its load-balancing loss is computed after the stack "
            f"from every layer's router logits, and under pp the last stage holds only its own layers; the logits of "
            f"earlier stages are carried to it only for decoder-only models that record them with transformers 5's "
            f"output hooks, not for {how}. {keep_off}")
    if num_microbatches > 1:
        raise MegatronConfigError(_microbatches_message(
            f"pp={pp} with num_microbatches={num_microbatches}, {name} and output_router_logits=True",
            f"{keep_off[0].lower()}{keep_off[1:]}"))


def _microbatches_message(what: str, otherwise: str) -> str:
    return (f"{what}: its load-balancing loss multiplies two statistics of the whole batch (the share of tokens each "
            "expert gets and its mean router probability), so computed per microbatch and averaged it differs from "
            "one device's, silently. Pass num_microbatches=1 (each microbatch is the whole batch; the logits of every "
            f"stage are carried to the last), or {otherwise}")


@dataclass
class RouterLogitsCarry:
    """What the stages of a model that records router logits do at each boundary: send those
    recorded so far, put those received in front. Carried whenever the model can record them, not
    only when its config asks: a forward may pass ``output_router_logits=True`` itself."""

    #: raised when logits arrive although setup allowed none (several microbatches: the config said no)
    refusal: Optional[str] = None

    def send(self, like: torch.Tensor) -> torch.Tensor:
        return stacked_router_logits(like)

    def receive(self, received: torch.Tensor) -> None:
        if received.numel() and self.refusal is not None:
            raise MegatronConfigError(self.refusal)
        prepend_router_logits(received)


def carry_for(hf: Optional[nn.Module], pp: int, num_microbatches: int) -> Optional[RouterLogitsCarry]:
    """The carry for ``hf``'s stages (``None``: a model that records no router logits)."""
    if not records_router_logits(hf):
        return None
    if num_microbatches == 1:
        return RouterLogitsCarry()
    return RouterLogitsCarry(_microbatches_message(
        f"pp={pp} with num_microbatches={num_microbatches} and {type(hf).__name__}, whose forward was called with "
        "output_router_logits=True", "call it without (config.output_router_logits is False), or use pp=1."))


def recorded_router_logits() -> Optional[list]:
    """The list the running forward records router logits into (``None`` when it records none)."""
    collector = _collector()
    collected = collector.get() if collector is not None else None
    return collected.get(KEY) if isinstance(collected, dict) else None


def stacked_router_logits(like: torch.Tensor) -> torch.Tensor:
    """Every router logit recorded so far in this forward, stacked in layer order (an empty tensor
    of ``like``'s dtype when none was: a stage of dense layers), to send with the hidden state."""
    logits = recorded_router_logits() or []
    if not logits:
        return like.new_zeros(0)
    shapes = {tuple(t.shape) for t in logits}
    if len(shapes) > 1:
        raise MegatronConfigError(
            f"the router logits recorded before a pipeline stage boundary have different shapes {sorted(shapes)}; "
            "they are carried to the last stage stacked, so they must share one. Use pp=1 for this model, or "
            "config.output_router_logits=False.")
    return torch.stack(logits)


def prepend_router_logits(received: torch.Tensor) -> None:
    """Put the earlier stages' router logits in front of this forward's record, in layer order."""
    record = recorded_router_logits()
    if record is None or received.numel() == 0:
        return
    record[:0] = list(received.unbind(0))


def map_recorded_router_logits(fn) -> None:
    """Replace each router logit recorded so far by ``fn(logit)`` (the setup probe unmarks what a
    stage receives from the previous one, :mod:`.stand_in_probe`)."""
    record = recorded_router_logits()
    if record:
        record[:] = [fn(t) for t in record]
