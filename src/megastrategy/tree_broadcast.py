"""Broadcast a pytree of tensors (a batch, a model's output) from one rank, in two messages.

Per step the pipeline broadcasts the batch within each model replica and relays the model's output
from the last stage; both are trees whose structure and dtypes repeat from step to step. So a
broadcast here is one fixed-size int64 header (shapes, dtypes, per-tensor codec data; a second
header message only when a tree has too many tensors to fit) and one byte buffer holding every
tensor, packed at aligned offsets. The structure around the tensors (containers, strings, ints) is
pickled only when it differs from the previous broadcast's, which in a training loop is once; a
per-step ``broadcast_object_list`` would cost a pickle and two extra messages every step.

The sender does not wait for its messages to arrive: it posts them and goes on (the receivers need
the value; the sender already has it). Otherwise the broadcast would hold the sender until the
slowest receiver reaches it: the pipeline's last stage, which relays the model's output and
finishes its schedule before the first stage does, would sit idle instead of stepping its
optimizer. The posted buffers are kept until the next broadcast (or :meth:`wait_sent`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megastrategy.batch_tree import flatten_batch, unflatten_batch
from megastrategy.errors import MegatronConfigError

__all__ = ["TreeBroadcast", "HEADER_SLOTS"]

HEADER_SLOTS = 64  # int64s in the first header message; longer headers take a second one
_ALIGN = 16  # byte alignment of each tensor in the packed buffer, so it can be viewed as its dtype
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64)
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}

# (tensor) -> (kind, plain tensor that travels, extra ints); kind 0 means "plain, no extras"
Encode = Callable[[Tensor], "tuple[int, Tensor, list[int]]"]
Decode = Callable[[int, Tensor, "list[int]"], Tensor]


def _plain_encode(t: Tensor) -> tuple[int, Tensor, list[int]]:
    return 0, t, []


def _plain_decode(kind: int, t: Tensor, extras: list[int]) -> Tensor:
    return t


class _TensorSlot:
    """Where a tensor sits among the leaves of a broadcast tree (all slots compare equal)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TensorSlot)

    def __hash__(self) -> int:
        return 0


class TreeBroadcast:
    """Collective over ``group``: :meth:`__call__` returns rank ``src``'s tree on every rank.

    ``encode``/``decode`` let a tensor subclass travel as a plain tensor plus a few ints (the
    pipeline relays vocabulary-parallel logits as the local shard). ``what`` names the broadcast in
    errors. ``last_bytes`` is what the last call moved (headers and payload).
    """

    def __init__(self, *, group: Any, src: int, device: Optional[torch.device], what: str,
                 encode: Encode = _plain_encode, decode: Decode = _plain_decode) -> None:
        self.group, self.src, self.what = group, src, what
        self.device = device if device is not None else torch.device("cpu")
        self._encode, self._decode = encode, decode
        self._structure: Any = None  # the last structure, the same on every rank
        self._in_flight: list[tuple[Any, Tensor]] = []  # the sender's posted messages and their buffers
        self.last_bytes = 0

    def __call__(self, value: Any = None) -> Any:
        if dist.get_rank() == self.src:
            return self._send(value)
        return self._receive()

    def wait_sent(self) -> None:
        """Wait until the messages this rank posted as the sender have left (a no-op elsewhere)."""
        in_flight, self._in_flight = self._in_flight, []
        for work, _ in in_flight:
            work.wait()

    # ------------------------------------------------------------------ sender
    def _send(self, value: Any) -> Any:
        self.wait_sent()
        leaves, spec = flatten_batch(value)
        tensors = [leaf.detach().to(self.device) for leaf in leaves if isinstance(leaf, Tensor)]
        structure = (spec, tuple(_TensorSlot() if isinstance(leaf, Tensor) else leaf for leaf in leaves))
        new = not _same(structure, self._structure)
        encoded = [self._encode(t) for t in tensors]
        header = [int(new), len(encoded)]
        for kind, plain, extras in encoded:
            header += [kind, self._dtype_code(plain.dtype), plain.dim(), *plain.shape, len(extras), *extras]
        self._broadcast_header(header)
        if new:
            self._structure = structure
            dist.broadcast_object_list([structure], src=self.src, group=self.group)
        layout = [(plain.dtype, tuple(plain.shape)) for _, plain, _ in encoded]
        buffer, views = _packed(layout, self.device)
        for view, (_, plain, _) in zip(views, encoded):
            view.copy_(plain)
        self._broadcast_payload(buffer, header)
        it = iter(tensors)
        return unflatten_batch([next(it) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)

    def _dtype_code(self, dtype: torch.dtype) -> int:
        if dtype not in _DTYPE_CODES:
            raise MegatronConfigError(
                f"{self.what}: a {dtype} tensor cannot be broadcast; supported dtypes: "
                f"{', '.join(str(d) for d in _DTYPES)}."
            )
        return _DTYPE_CODES[dtype]

    # ------------------------------------------------------------------ receivers
    def _receive(self) -> Any:
        header = self._broadcast_header(None)
        new, count, rest = header[0], header[1], header[2:]
        if new:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            self._structure = box[0]
        described = []
        for _ in range(count):
            kind, code, ndim = rest[:3]
            shape, rest = tuple(rest[3:3 + ndim]), rest[3 + ndim:]
            extras, rest = rest[1:1 + rest[0]], rest[1 + rest[0]:]
            described.append((kind, _DTYPES[code], shape, extras))
        buffer, views = _packed([(dtype, shape) for _, dtype, shape, _ in described], self.device)
        self._broadcast_payload(buffer, header)
        tensors = iter([self._decode(kind, view, extras) for view, (kind, _, _, extras) in zip(views, described)])
        spec, leaves = self._structure
        return unflatten_batch([next(tensors) if isinstance(leaf, _TensorSlot) else leaf for leaf in leaves], spec)

    # ------------------------------------------------------------------ messages
    def _broadcast_header(self, header: Optional[list[int]]) -> list[int]:
        """The header's length first, then the header; one message up to ``HEADER_SLOTS`` ints."""
        first = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=self.device)
        if header is not None:
            full = torch.tensor([len(header) + 1, *header], dtype=torch.int64, device=self.device)
            first[:min(len(full), HEADER_SLOTS)] = full[:HEADER_SLOTS]
        self._broadcast(first)
        length = int(first[0])
        if length <= HEADER_SLOTS:
            return first[1:length].tolist()
        rest = full[HEADER_SLOTS:] if header is not None else torch.empty(
            length - HEADER_SLOTS, dtype=torch.int64, device=self.device)
        self._broadcast(rest)
        return torch.cat([first[1:], rest]).tolist()

    def _broadcast_payload(self, buffer: Tensor, header: list[int]) -> None:
        if buffer.numel():
            self._broadcast(buffer)
        messages = HEADER_SLOTS if len(header) + 1 <= HEADER_SLOTS else len(header) + 1
        self.last_bytes = 8 * messages + buffer.numel()

    def _broadcast(self, tensor: Tensor) -> None:
        """One message: posted without waiting on the sender, waited for on a receiver."""
        if dist.get_rank() != self.src:
            dist.broadcast(tensor, src=self.src, group=self.group)
            return
        self._in_flight.append((dist.broadcast(tensor, src=self.src, group=self.group, async_op=True), tensor))


def _packed(layout: list[tuple[torch.dtype, tuple[int, ...]]], device: torch.device) -> tuple[Tensor, list[Tensor]]:
    """One byte buffer for tensors of ``layout`` (dtype, shape), and a typed view of each."""
    offsets, total = [], 0
    for dtype, shape in layout:
        offsets.append(total)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        total += -(-nbytes // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    views = []
    for (dtype, shape), offset in zip(layout, offsets):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        views.append(buffer[offset:offset + nbytes].view(dtype).view(shape))
    return buffer, views


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without a plain equality (arrays): treat as changed
        return False
