"""Learn each Hugging Face layer's mask rule from the mask transformers would build for it.

Why: a model decides per layer which mask its attention uses (full causal, sliding window,
bidirectional), and it does not always say so to the attention function: Exaone4, ExaoneMoE and
Kolibri1 pass ``sliding_window=None`` to full layers whose module still holds the config's
window, and a model may leave the window to the mask alone. Reading ``module.sliding_window`` or
the keyword gave silently wrong windows (losses 1.8e-3..9.2e-3 off at cp2). The mask the model asks
for is the ground truth, so while a split microbatch runs, ring attention's key also gets a
*mask* function: transformers hands it the model's ``mask_function`` (an index rule), which is
probed on global positions and classified as causal / bidirectional with an optional window.
What it returns is a marker tensor; the attention function looks the rule up by that marker.

A rule the ring cannot reproduce (chunked attention, bidirectional image blocks, packed
sequences, a window that is not a band) is refused, naming the layer, at the call.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megastrategy.errors import MegatronConfigError

Rule = tuple[bool, Optional[int]]  # (causal, window)


def probe_rows(seq_len: int) -> list[int]:
    """Query positions whose rows are compared with the candidate rule (first, middle, last)."""
    return sorted({q for q in (0, 1, 2, seq_len // 3, seq_len // 2, seq_len - 2, seq_len - 1) if 0 <= q < seq_len})


def expected_rows(rows: torch.Tensor, seq_len: int, causal: bool, window: Optional[int]) -> torch.Tensor:
    """``(len(rows), seq_len)`` bool: what the ring's rule lets each probed query see."""
    q, k = rows[:, None], torch.arange(seq_len)[None, :]
    allowed = k <= q if causal else torch.ones(len(rows), seq_len, dtype=torch.bool)
    return allowed & (k > q - window) if window is not None else allowed


def classify(mask_function: Callable, seq_len: int, where: str) -> Rule:
    """The (causal, window) rule ``mask_function`` applies on a sequence of ``seq_len`` global positions."""
    rows = torch.tensor(probe_rows(seq_len))
    zero = torch.zeros((), dtype=torch.long)
    try:
        seen = mask_function(zero, zero, rows[:, None], torch.arange(seq_len)[None, :])
        seen = torch.as_tensor(seen, dtype=torch.bool).expand(len(rows), seq_len)
    except Exception as e:  # noqa: BLE001 - a rule over local tensors (packed ids, image blocks) fails here
        raise _refusal(where, f"its mask rule cannot be evaluated on global positions ({type(e).__name__}: {e})") from e
    causal = seq_len == 1 or not bool(seen[0, 1:].any())  # the first query sees no later key
    visible = int(seen[-1].sum())
    window = visible if causal and visible < seq_len else None  # the last query sees `window` keys back
    if not torch.equal(seen, expected_rows(rows, seq_len, causal, window)):
        raise _refusal(where, "its mask is neither causal nor bidirectional, with an optional causal sliding "
                              "window (chunked attention, bidirectional blocks inside a causal sequence, packed "
                              "sequences, a two-sided window)")
    return causal, window


def _refusal(where: str, why: str) -> MegatronConfigError:
    return MegatronConfigError(
        f"attention in {where} with cp > 1: {why}; ring attention reproduces only causal or bidirectional "
        "masks with an optional sliding window. Use cp=1 for this model."
    )


class MaskMarkers:
    """Marker tensors handed out as masks during one forward, and the rule each stands for."""

    def __init__(self):
        self.rules: dict[int, tuple[torch.Tensor, Rule]] = {}

    def make(self, rule: Rule, batch_size: int, q_length: int, device=None) -> torch.Tensor:
        """On the batch's device, so a model's ``mask.to(device)`` keeps the marker itself."""
        marker = torch.ones((batch_size, 1, q_length, 0), dtype=torch.bool, device=device)  # no storage
        self.rules[id(marker)] = (marker, rule)
        return marker

    def derived(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` may be a marker or computed from one (``~mask[:, 0]``): an empty boolean
        tensor while markers exist (used only to explain an operation that failed)."""
        return bool(self.rules) and tensor.numel() == 0 and tensor.dtype == torch.bool

    def rule_of(self, mask: torch.Tensor) -> Optional[Rule]:
        """The rule behind ``mask`` (a marker or a view of one), None for any other tensor."""
        for candidate in (mask, getattr(mask, "_base", None)):
            entry = self.rules.get(id(candidate)) if candidate is not None else None
            if entry is not None and entry[0] is candidate:
                return entry[1]
        return None
