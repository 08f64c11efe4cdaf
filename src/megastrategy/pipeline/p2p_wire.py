"""What a pipeline message looks like on the wire, and what each end of a link expects next.

A tensor crossing a stage boundary is described by its :class:`Meta` (dtype, shape, transfer
mode). Two ways to carry it:

* **described**: an int64 *header* (the meta and the microbatch) on one tag, then the
  payload on another. Used when the receiver cannot know the size in advance.
* **predicted**: one message, the payload followed by a small fixed *trailer* (magic,
  direction, flag, microbatch, meta signature). Used when both ends predict the same meta.

Prediction (:class:`LinkMemory`): a pipeline step sends the same tensors every step, so each
end of a link remembers, per (step label, direction, position of the message within the
step), the meta it saw last time. Both ends see the same sequence of messages on the link
and start a step at the same point of it, so their predictions always agree: the receiver
posts a buffer of the predicted size, and the sender, knowing what was predicted, sends
either the one predicted message or, when the tensor changed, a *resync* message of the
predicted size flagged as such, followed by the described form on tags of their own.
Outside a step (no label) nothing is predicted and every message is described.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

__all__ = ["Meta", "LinkMemory", "MAX_NDIM", "HEADER_LEN", "TRAILER_BYTES"]

MAGIC = 0x4D53_5050  # "MSPP"
MAX_NDIM = 10
HEADER_LEN = 6 + MAX_NDIM  # magic, kind, dtype code, ndim, mode, microbatch, dims...
TRAILER_LEN = 4  # magic, kind * 16 + flag, microbatch, meta signature
TRAILER_BYTES = TRAILER_LEN * 8

MODE_FULL = 0  # whole tensor in one payload
MODE_SCATTER = 1  # each TP rank sends 1/tp of the bytes; receivers all-gather
MODE_EMPTY = 2  # numel == 0: no payload
MODES = (MODE_FULL, MODE_SCATTER, MODE_EMPTY)

FLAG_DATA = 1  # the trailer closes the predicted payload
FLAG_RESYNC = 2  # the prediction was wrong: the described form follows on the resync tags

DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype) and _dt not in DTYPES:
        DTYPES.append(_dt)
DTYPE_CODES = {dt: i for i, dt in enumerate(DTYPES)}


def fmt_shape(shape: Sequence[int] | None) -> str:
    return "None" if shape is None else "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


class Meta(NamedTuple):
    """Everything the receiver must know to allocate and interpret a payload."""

    code: int  # index into DTYPES
    mode: int
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: Tensor, mode: int) -> "Meta":
        if tensor.dim() > MAX_NDIM:
            raise ValueError(
                f"pipeline p2p can send tensors of at most {MAX_NDIM} dimensions; got shape "
                f"{fmt_shape(tensor.shape)}. Reshape the activation before it crosses a stage boundary."
            )
        code = DTYPE_CODES.get(tensor.dtype)
        if code is None:
            raise TypeError(f"pipeline p2p cannot send dtype {tensor.dtype} (supported: {DTYPES}).")
        return cls(code, mode, tuple(int(d) for d in tensor.shape))

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.code]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize

    def wire_bytes(self, tp_size: int) -> int:
        """Payload bytes one rank sends: the ``1/tp`` slice under scatter-gather."""
        if self.mode == MODE_EMPTY:
            return 0
        return self.nbytes // tp_size if self.mode == MODE_SCATTER else self.nbytes

    def signature(self) -> int:
        """A deterministic 62-bit digest (the same in every process, unlike salted hashes)."""
        value = 1469598103934665603
        for v in (self.code, self.mode, len(self.shape), *self.shape):
            value = ((value ^ (v & 0xFFFF_FFFF_FFFF)) * 1099511628211) % (1 << 62)
        return value

    def header(self, kind: int, microbatch: int) -> list[int]:
        values = [MAGIC, kind, self.code, len(self.shape), self.mode, int(microbatch), *self.shape]
        return values + [0] * (HEADER_LEN - len(values))

    @classmethod
    def parse_header(cls, values: list[int], kind: int) -> tuple["Meta", int] | None:
        """``(meta, microbatch)``, or ``None`` when ``values`` is not a header of direction ``kind``."""
        magic, got_kind, code, ndim, mode, microbatch = values[:6]
        if magic != MAGIC or got_kind != kind or not 0 <= ndim <= MAX_NDIM or not 0 <= code < len(DTYPES):
            return None
        if mode not in MODES:
            return None
        return cls(code, mode, tuple(values[6 : 6 + ndim])), microbatch


def trailer(kind: int, flag: int, microbatch: int, meta: Meta) -> list[int]:
    return [MAGIC, kind * 16 + flag, int(microbatch), meta.signature()]


def parse_trailer(values: list[int], kind: int) -> tuple[int, int, int] | None:
    """``(flag, microbatch, signature)``, or ``None`` when ``values`` is not a trailer of ``kind``."""
    magic, kind_flag, microbatch, sig = values
    if magic != MAGIC or kind_flag // 16 != kind or kind_flag % 16 not in (FLAG_DATA, FLAG_RESYNC):
        return None
    return kind_flag % 16, microbatch, sig


class LinkMemory:
    """One end's memory of one direction of one link: the meta seen at each step position.

    :meth:`begin` starts a step (positions restart at 0; the label separates step kinds
    whose messages differ, such as training and forward-only steps). :meth:`next_key` is
    called once per message in the order of the link's messages; :meth:`predict` and
    :meth:`remember` read and write the meta at that key.
    """

    def __init__(self) -> None:
        self.label: object = None
        self.position = 0
        self.seen: dict[tuple[object, int], Meta] = {}

    def begin(self, label: object) -> None:
        self.label, self.position = label, 0

    def next_key(self) -> tuple[object, int] | None:
        if self.label is None:
            return None
        key = (self.label, self.position)
        self.position += 1
        return key

    def predict(self, key: tuple[object, int] | None) -> Meta | None:
        return None if key is None else self.seen.get(key)

    def remember(self, key: tuple[object, int] | None, meta: Meta) -> None:
        if key is not None:
            self.seen[key] = meta
