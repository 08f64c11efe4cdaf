"""Point-to-point messages between neighbouring pipeline stages.

Inside a step (:meth:`PipelineCommunicator.begin_step`, called by the executor) a tensor
whose dtype, shape and transfer mode are those of the tensor at the same position of the
previous step travels as ONE message: its payload followed by a 32-byte trailer (direction,
microbatch id, a signature of the shape), received into a buffer posted at the predicted
size. Otherwise (the first step, a changed shape, or outside steps) it is *described*: an
int64 header (direction, dtype, shape, mode, microbatch) then the payload, after a *resync*
notice of the predicted size when a prediction was wrong (:mod:`.p2p_wire` has the
protocol). So after the first step every rank sends and receives the schedule's minimum, one
message per tensor crossing a boundary, while microbatches of changing sequence lengths and
any dtype still flow, and the receiver checks what it got (a message from the wrong
direction, an unexpected shape or microbatch) with an error instead of a hang or garbage.

Activations (``forward``, to the next stage) and gradients (``backward``, to the previous
stage) use distinct tags, so they cannot be confused even when the previous and the next
stage are the same rank (``pp_size == 2`` with the ring the interleaved schedule needs).
Predicted messages, headers, headers after a resync and described payloads have their own
tags; within one tag messages between a pair of ranks are matched first-in first-out, so
receives must be posted in the order the peer sends (the executor posts them in schedule
order).

Sends are asynchronous: the communicator keeps every send's buffers alive until its
``Work`` completes (checked on every later call, forced by :meth:`wait_all`), so a caller
may drop or pseudo-free the tensor it sent right away.

Scatter-gather: with a tensor-parallel group of size ``tp > 1`` the activation (and its
gradient) is the same on every TP rank, so each TP rank sends only its ``1/tp`` slice of
the flattened bytes to its counterpart in the neighbouring stage, and the receiving TP
ranks all-gather the slices. Used when the element count is divisible by ``tp``; a plain
full send otherwise (the meta says which, so both sides always agree). It must be off
(``scatter_gather=False``) when the tensors crossing stages differ between TP ranks, as
with sequence parallelism.

Tags only separate messages on backends that honour them (gloo, and the in-process
loopback used when ``pp_size == 1``). NCCL ignores tags; pass ``grad_group`` (a second
process group over the same ranks) to keep gradients on their own communicator there.

Wire device: gloo cannot send or receive CUDA tensors point to point (its collectives can), so
with CUDA tensors on a gloo group (several ranks sharing one GPU, where NCCL refuses) messages
travel through host memory and received tensors are moved to ``device``.
"""

from __future__ import annotations

import datetime
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megastrategy.collectives import all_gather_single
from megastrategy.pipeline.p2p_wire import (
    FLAG_DATA, FLAG_RESYNC, HEADER_LEN, MAX_NDIM, MODE_EMPTY, MODE_FULL, MODE_SCATTER, TRAILER_BYTES, LinkMemory,
    Meta, fmt_shape, parse_trailer, trailer,
)

__all__ = ["PipelineCommunicator", "RecvHandle", "MAX_NDIM", "HEADER_LEN"]

FORWARD = 0
BACKWARD = 1
_KIND_NAMES = {FORWARD: "activation (forward)", BACKWARD: "gradient (backward)"}

# Tags: per direction, one stream of predicted messages (payload + trailer, and resync
# notices), one of headers posted with the receive, one of headers that follow a resync, and
# one of described payloads. Arbitrary values away from 0, the tag plain ``dist.send`` uses.
_TAG_BASE = 0x4D5000
_STREAMS = ("data", "hdr", "rhdr", "full")
_TAGS = {(kind, name): _TAG_BASE + 1 + 4 * kind + i for kind in (FORWARD, BACKWARD) for i, name in enumerate(_STREAMS)}

_gather_single_ok = True


def _kind(direction: str) -> int:
    if direction == "forward":
        return FORWARD
    if direction == "backward":
        return BACKWARD
    raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}.")


def _as_bytes(t: Tensor) -> Tensor:
    """Flat uint8 view of a contiguous tensor (a copy only when ``t`` is not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)  # shares storage with ``t`` when it was contiguous


def wire_device(group, device: torch.device) -> torch.device:
    """Where p2p buffers live: ``device``, or the CPU when only gloo serves CUDA tensors."""
    if device.type != "cuda" or not (dist.is_available() and dist.is_initialized()):
        return device
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cpu") if "gloo" in backend and "nccl" not in backend else device


class _Send:
    """Keeps the buffers of one posted send alive until its works complete."""

    __slots__ = ("works", "buffers")

    def __init__(self, works: list, buffers: list[Tensor]) -> None:
        self.works = works
        self.buffers = buffers

    def done(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)


class _LoopbackRecv:
    """A receive from this rank itself; the copy happens when it is waited on."""

    def __init__(self, comm: "PipelineCommunicator", buf: Tensor, tag: int) -> None:
        self._comm, self._buf, self._tag, self._done = comm, buf, tag, False

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout=None) -> bool:
        if not self._done:
            box = self._comm._loopback[self._tag]
            if not box:
                raise RuntimeError(
                    "nothing was sent to this rank by itself (pp_size == 1 or the turn of a V) yet: the schedule receives before it sends"
                )
            self._buf.copy_(box.popleft())
            self._done = True
        return True


class RecvHandle:
    """A posted receive: its first message is on its way; :meth:`wait` returns the tensor.

    The first message is the predicted payload with its trailer when the link's memory
    predicts the tensor (:mod:`.p2p_wire`), else the header. Handles of one direction
    complete in the order they were posted (waiting on a later one first completes the
    earlier ones), which keeps the first-in first-out matching of every stream intact.
    """

    def __init__(self, comm: "PipelineCommunicator", kind: int, peer: int, posted: tuple, works: list,
                 expect: tuple) -> None:
        self._comm = comm
        self.kind = kind
        self.peer = peer
        self._key, self._predicted, self._buf = posted
        self._works = works
        expect_shape, self._expect_dtype, self._expect_microbatch = expect
        self._expect_shape = None if expect_shape is None else tuple(int(d) for d in expect_shape)
        self._result: Tensor | None = None
        self._error: BaseException | None = None
        self._done = False

    def wait(self) -> Tensor:
        queue = self._comm._recv_queues[self.kind]
        while not self._done:
            queue[0]._complete()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        result, self._result = self._result, None  # hand over; the handle keeps no reference
        return result

    # ------------------------------------------------------------------------------
    def _complete(self) -> None:
        comm = self._comm
        queue = comm._recv_queues[self.kind]
        assert queue and queue[0] is self
        queue.popleft()
        self._done = True
        try:
            self._result = self._finish()
        except BaseException as err:  # noqa: BLE001 - re-raised from wait()
            self._error = err

    def _finish(self) -> Tensor:
        comm = self._comm
        what = f"{comm._direction_word(self.kind)} from rank {self.peer}"
        buf, self._buf = self._buf, None
        comm._wait_works(self._works, f"the first message of the {what}", keep=[buf])
        if self._predicted is None:
            meta, microbatch = self._described(buf, what)
            result = comm._recv_described(self.kind, self.peer, meta, what)
        else:
            meta, microbatch, result = self._predicted_result(buf, what)
        comm._link("recv", self.kind, self.peer).remember(self._key, meta)  # consumed: both ends stay in step
        problem = self._mismatch(meta, microbatch)
        if problem:
            raise RuntimeError(f"pipeline p2p on rank {comm.rank}: {what}: {problem}")
        return result.to(comm.device)

    def _predicted_result(self, buf: Tensor, what: str) -> tuple[Meta, int, Tensor]:
        """Interpret the predicted message: the payload itself, or a resync notice."""
        comm, meta = self._comm, self._predicted
        n = len(buf) - TRAILER_BYTES
        values = buf[n:].clone().view(torch.int64).tolist()
        parsed = parse_trailer(values, self.kind)
        if parsed is None:
            raise comm._corrupt(self.kind, what, values)
        flag, microbatch, sig = parsed
        if flag == FLAG_RESYNC:
            comm.stats["resyncs_received"] += 1
            header = torch.empty(HEADER_LEN, dtype=torch.int64, device=comm.wire)
            comm._recv_stream(self.kind, self.peer, header, "rhdr", f"the header of the {what}")
            meta, microbatch = self._described(header, what)
            return meta, microbatch, comm._recv_described(self.kind, self.peer, meta, what)
        if sig != meta.signature():
            raise comm._corrupt(self.kind, what, values)
        if meta.mode != MODE_SCATTER:
            return meta, microbatch, buf[:n].view(meta.dtype).reshape(meta.shape)
        result = torch.empty(meta.shape, dtype=meta.dtype, device=comm.wire)
        comm._gather_bytes(buf[:n], _as_bytes(result))
        return meta, microbatch, result

    def _described(self, header: Tensor, what: str) -> tuple[Meta, int]:
        values = [int(v) for v in header.tolist()]
        parsed = Meta.parse_header(values, self.kind)
        if parsed is None:
            raise self._comm._corrupt(self.kind, what, values)
        return parsed

    def _mismatch(self, meta: Meta, microbatch: int) -> str:
        shape, dtype = meta.shape, meta.dtype
        shape_bad = self._expect_shape is not None and shape != self._expect_shape
        dtype_bad = self._expect_dtype is not None and dtype != self._expect_dtype
        if shape_bad or dtype_bad:
            expected_shape = "any shape" if self._expect_shape is None else f"shape {fmt_shape(self._expect_shape)}"
            expected_dtype = "any dtype" if self._expect_dtype is None else f"dtype {self._expect_dtype}"
            return (
                f"expected {expected_shape} {expected_dtype}, received shape {fmt_shape(shape)} dtype {dtype}"
                + (f" (microbatch {microbatch})" if microbatch >= 0 else "")
                + "."
            )
        if self._expect_microbatch is not None and microbatch >= 0 and microbatch != self._expect_microbatch:
            return (
                f"expected the message of microbatch {self._expect_microbatch}, received microbatch {microbatch} "
                f"(shape {fmt_shape(shape)} {dtype}); the two stages run different schedules."
            )
        return ""


class PipelineCommunicator:
    """Sends activations down and gradients up a pipeline of ranks (a ring: the last
    stage's next is the first stage, as the interleaved schedule needs).

    ``pp_ranks`` are the global ranks of this rank's pipeline group in stage order and
    ``pp_rank`` this rank's position in it. Receives return tensors on ``device``;
    ``dtype`` is the pipeline's nominal activation dtype (informational: every message
    carries its own dtype). ``timeout`` (seconds) bounds every wait; on expiry a
    ``RuntimeError`` names the peer and the message.

    ``stats`` counts what this rank sent: ``messages`` (tensors sent), ``bytes`` (payload
    bytes, i.e. the ``1/tp`` slice under scatter-gather), ``header_bytes`` (headers and
    trailers), ``scatter_gather`` (tensors sent as slices), ``resyncs`` (mispredicted tensors
    sent); and what it put on the wire: ``wire_sends`` and ``wire_recvs`` (point-to-point
    messages posted), ``resyncs_received``.
    """

    def __init__(
        self,
        *,
        pp_group,
        pp_ranks: list[int],
        pp_rank: int,
        device,
        dtype: torch.dtype = torch.float32,
        tp_group=None,
        scatter_gather: bool = True,
        timeout: float | None = None,
        grad_group=None,
    ) -> None:
        pp_ranks = [int(r) for r in pp_ranks]
        if not pp_ranks:
            raise ValueError("pp_ranks must list the pipeline group's global ranks (got an empty list).")
        if not 0 <= pp_rank < len(pp_ranks):
            raise ValueError(f"pp_rank={pp_rank} is out of range for pp_ranks={pp_ranks}.")
        self.pp_group = pp_group
        self.grad_group = pp_group if grad_group is None else grad_group
        self.pp_ranks = pp_ranks
        self.pp_rank = pp_rank
        self.pp_size = len(pp_ranks)
        self.rank = pp_ranks[pp_rank]
        self.next_rank = pp_ranks[(pp_rank + 1) % self.pp_size]
        self.prev_rank = pp_ranks[(pp_rank - 1) % self.pp_size]
        self.device = torch.device(device)
        self.wire = wire_device(pp_group, self.device)
        self.dtype = dtype
        self.tp_group = tp_group
        self.tp_size = 1
        self.tp_rank = 0
        if tp_group is not None and dist.is_available() and dist.is_initialized():
            self.tp_size = dist.get_world_size(tp_group)
            self.tp_rank = dist.get_rank(tp_group)
        self.scatter_gather = bool(scatter_gather)
        self.timeout = timeout
        self.stats: dict[str, int] = dict.fromkeys(
            ("messages", "bytes", "header_bytes", "scatter_gather", "wire_sends", "wire_recvs", "resyncs",
             "resyncs_received"), 0)
        # what each end of this rank's links predicts, per ("send" | "recv", direction)
        self._memory: dict[tuple[str, int, int], LinkMemory] = {}  # (side, kind, peer) -> memory
        self._label: object = None  # the current step's label (None: outside a step, nothing predicted)
        self._pending_sends: list[_Send] = []
        self._abandoned: list[Tensor] = []  # buffers of transfers whose wait failed (kept alive)
        self._recv_queues: dict[int, deque[RecvHandle]] = {FORWARD: deque(), BACKWARD: deque()}
        # in-process mailbox for messages to this rank itself (pp_size == 1, a V's turn): tag -> tensors
        self._loopback: dict[int, deque[Tensor]] = {tag: deque() for tag in _TAGS.values()}

    # ------------------------------------------------------------------------------
    # public primitives
    # ------------------------------------------------------------------------------
    def send_forward(self, tensor: Tensor, *, microbatch: int = -1) -> None:
        """Send an activation to the next stage (asynchronous)."""
        self._post(self._send_ops(FORWARD, tensor, microbatch))

    def send_backward(self, tensor: Tensor, *, microbatch: int = -1) -> None:
        """Send a gradient to the previous stage (asynchronous)."""
        self._post(self._send_ops(BACKWARD, tensor, microbatch))

    def recv_forward(self, *, expect_shape=None, expect_dtype=None, expect_microbatch=None) -> Tensor:
        """Receive an activation from the previous stage."""
        return self.irecv_forward(
            expect_shape=expect_shape, expect_dtype=expect_dtype, expect_microbatch=expect_microbatch
        ).wait()

    def recv_backward(self, *, expect_shape=None, expect_dtype=None, expect_microbatch=None) -> Tensor:
        """Receive a gradient from the next stage."""
        return self.irecv_backward(
            expect_shape=expect_shape, expect_dtype=expect_dtype, expect_microbatch=expect_microbatch
        ).wait()

    def irecv_forward(self, *, expect_shape=None, expect_dtype=None, expect_microbatch=None) -> RecvHandle:
        """Post the receive of an activation from the previous stage; ``.wait()`` returns it."""
        return self._post(None, self._recv_op(FORWARD, expect_shape, expect_dtype, expect_microbatch))

    def irecv_backward(self, *, expect_shape=None, expect_dtype=None, expect_microbatch=None) -> RecvHandle:
        """Post the receive of a gradient from the next stage; ``.wait()`` returns it."""
        return self._post(None, self._recv_op(BACKWARD, expect_shape, expect_dtype, expect_microbatch))

    def send_forward_recv_backward(
        self, tensor: Tensor, *, microbatch: int = -1, expect_shape=None, expect_dtype=None, expect_microbatch=None
    ) -> Tensor:
        """Send an activation to the next stage and receive a gradient from it, in one batch."""
        return self.send_and_irecv(
            "forward", tensor, "backward", microbatch=microbatch, expect_shape=expect_shape,
            expect_dtype=expect_dtype, expect_microbatch=expect_microbatch,
        ).wait()

    def send_backward_recv_forward(
        self, tensor: Tensor, *, microbatch: int = -1, expect_shape=None, expect_dtype=None, expect_microbatch=None
    ) -> Tensor:
        """Send a gradient to the previous stage and receive an activation from it, in one batch."""
        return self.send_and_irecv(
            "backward", tensor, "forward", microbatch=microbatch, expect_shape=expect_shape,
            expect_dtype=expect_dtype, expect_microbatch=expect_microbatch,
        ).wait()

    def send_forward_recv_forward(
        self, tensor: Tensor, *, microbatch: int = -1, expect_shape=None, expect_dtype=None, expect_microbatch=None
    ) -> Tensor:
        """Send an activation to the next stage and receive one from the previous stage, in one batch."""
        return self.send_and_irecv(
            "forward", tensor, "forward", microbatch=microbatch, expect_shape=expect_shape,
            expect_dtype=expect_dtype, expect_microbatch=expect_microbatch,
        ).wait()

    def send_backward_recv_backward(
        self, tensor: Tensor, *, microbatch: int = -1, expect_shape=None, expect_dtype=None, expect_microbatch=None
    ) -> Tensor:
        """Send a gradient to the previous stage and receive one from the next stage, in one batch."""
        return self.send_and_irecv(
            "backward", tensor, "backward", microbatch=microbatch, expect_shape=expect_shape,
            expect_dtype=expect_dtype, expect_microbatch=expect_microbatch,
        ).wait()

    def send_and_irecv(
        self,
        send: str | None,
        tensor: Tensor | None,
        recv: str | None,
        *,
        microbatch: int = -1,
        expect_shape=None,
        expect_dtype=None,
        expect_microbatch=None,
        send_to: int | None = None,
        recv_from: int | None = None,
    ) -> RecvHandle | None:
        """The general primitive: post an optional send (``"forward"`` to the next stage or
        ``"backward"`` to the previous one) and an optional receive (``"forward"``: an
        activation from the previous stage, ``"backward"``: a gradient from the next one) in
        one batch. Returns the receive's handle (``None`` without a receive).

        ``send_to``/``recv_from``: the peer's pipeline position (index into ``pp_ranks``) when it
        is not the ring neighbour the direction implies, as under a V placement (chunk 1 sends
        its activations up the ranks; the turn of the V is this rank itself, a local copy)."""
        send_ops = None
        if send is not None:
            if tensor is None:
                raise ValueError(f"send={send!r} needs a tensor.")
            send_ops = self._send_ops(_kind(send), tensor, microbatch, self._peer(send_to))
        recv_op = None
        if recv is not None:
            recv_op = self._recv_op(_kind(recv), expect_shape, expect_dtype, expect_microbatch, self._peer(recv_from))
        return self._post(send_ops, recv_op)

    def _peer(self, position: int | None) -> int | None:
        """The global rank at pipeline position ``position`` (``None``: the direction's ring neighbour)."""
        if position is None:
            return None
        if not 0 <= position < self.pp_size:
            raise ValueError(f"peer position {position} is outside the pipeline [0, {self.pp_size}).")
        return self.pp_ranks[position]

    def begin_step(self, label: object = "step") -> None:
        """Start a step: message positions restart, and each end predicts every tensor to be the
        one at the same position of the last step with this ``label`` (:mod:`.p2p_wire`). The
        neighbours must begin their steps at the same point of the message streams (every rank's
        executor run begins one, and completes all its messages before returning)."""
        self._label = label
        for memory in self._memory.values():
            memory.begin(label)

    def _link(self, side: str, kind: int, peer: int) -> LinkMemory:
        """This end's memory of the messages of direction ``kind`` to or from ``peer``: one per
        link, since a V placement sends one direction to both neighbours, each its own stream."""
        memory = self._memory.get((side, kind, peer))
        if memory is None:
            memory = self._memory[(side, kind, peer)] = LinkMemory()
            memory.begin(self._label)
        return memory

    def wait_all(self) -> None:
        """Complete every posted receive (results are kept for their handles) and send."""
        for kind in (FORWARD, BACKWARD):
            queue = self._recv_queues[kind]
            while queue:
                queue[0]._complete()
        while self._pending_sends:
            send = self._pending_sends.pop(0)
            self._wait_works(send.works, "a send", keep=send.buffers)

    @property
    def pending_sends(self) -> int:
        """Sends posted whose completion has not been observed yet."""
        self._reap()
        return len(self._pending_sends)

    def reset_stats(self) -> None:
        for key in self.stats:
            self.stats[key] = 0

    # ------------------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------------------
    def _direction_word(self, kind: int) -> str:
        return "activation" if kind == FORWARD else "gradient"

    def _group(self, kind: int):
        return self.pp_group if kind == FORWARD else self.grad_group

    def _header_tensor(self, kind: int, meta: Meta, microbatch: int) -> Tensor:
        return torch.tensor(meta.header(kind, microbatch), dtype=torch.int64, device=self.wire)

    def _send_ops(
        self, kind: int, tensor: Tensor, microbatch: int, peer: int | None = None
    ) -> list[tuple[str, Tensor, int, int, Any]]:
        """(op, buffer, peer, tag, group) tuples sending ``tensor`` in direction ``kind`` (to
        ``peer``, a global rank, or by default the direction's ring neighbour): the one predicted
        message, or (nothing predicted) header and payload, or (mispredicted) a resync notice of
        the predicted size, header and payload."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"pipeline p2p can only send tensors, got {type(tensor).__name__}.")
        if peer is None:
            peer = self.next_rank if kind == FORWARD else self.prev_rank
        tensor = tensor.detach()
        if tensor.device != self.wire:
            tensor = tensor.to(self.wire)
        if tensor.numel() == 0:
            mode = MODE_EMPTY
        elif self.scatter_gather and self.tp_size > 1 and peer != self.rank and tensor.numel() % self.tp_size == 0:
            mode = MODE_SCATTER
        else:
            mode = MODE_FULL
        meta = Meta.of(tensor, mode)
        memory = self._link("send", kind, peer)
        key = memory.next_key()
        predicted = memory.predict(key)
        memory.remember(key, meta)
        payload = self._payload_piece(tensor, meta)
        self.stats["messages"] += 1
        self.stats["bytes"] += payload.numel()
        if predicted == meta:
            return [self._op(kind, peer, "data", self._with_trailer(payload, kind, FLAG_DATA, microbatch, meta))]
        ops = []
        if predicted is not None:  # the receiver posted a buffer of the predicted size: fill it, flagged
            notice = torch.zeros(predicted.wire_bytes(self.tp_size), dtype=torch.uint8, device=self.wire)
            ops.append(self._op(kind, peer, "data", self._with_trailer(notice, kind, FLAG_RESYNC, microbatch, meta)))
            self.stats["resyncs"] += 1
        header = self._header_tensor(kind, meta, microbatch)
        self.stats["header_bytes"] += header.numel() * header.element_size()
        ops.append(self._op(kind, peer, "hdr" if predicted is None else "rhdr", header))
        if mode != MODE_EMPTY:
            ops.append(self._op(kind, peer, "full", payload))
        return ops

    def _payload_piece(self, tensor: Tensor, meta: Meta) -> Tensor:
        """The bytes this rank sends: all of them, or its ``1/tp`` slice under scatter-gather."""
        payload = _as_bytes(tensor)
        if meta.mode == MODE_SCATTER:
            piece = meta.wire_bytes(self.tp_size)
            payload = payload[self.tp_rank * piece : (self.tp_rank + 1) * piece]
            self.stats["scatter_gather"] += 1
        return payload

    def _with_trailer(self, payload: Tensor, kind: int, flag: int, microbatch: int, meta: Meta) -> Tensor:
        """``payload`` followed by the trailer, in one buffer (one copy of the payload)."""
        n = payload.numel()
        buf = torch.empty(n + TRAILER_BYTES, dtype=torch.uint8, device=self.wire)
        buf[:n].copy_(payload)
        tail = torch.tensor(trailer(kind, flag, microbatch, meta), dtype=torch.int64)
        buf[n:].copy_(tail.view(torch.uint8))
        self.stats["header_bytes"] += TRAILER_BYTES
        return buf

    def _op(self, kind: int, peer: int, stream: str, buf: Tensor, op: str = "send") -> tuple:
        return (op, buf, peer, _TAGS[(kind, stream)], self._group(kind))

    def _recv_op(self, kind, expect_shape, expect_dtype, expect_microbatch, peer: int | None = None):
        """The first receive of a message: the predicted payload and trailer, or the header."""
        if peer is None:
            peer = self.prev_rank if kind == FORWARD else self.next_rank
        memory = self._link("recv", kind, peer)
        key = memory.next_key()
        predicted = memory.predict(key)
        if predicted is None:
            buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.wire)
            op = self._op(kind, peer, "hdr", buf, "recv")
        else:
            buf = torch.empty(predicted.wire_bytes(self.tp_size) + TRAILER_BYTES, dtype=torch.uint8, device=self.wire)
            op = self._op(kind, peer, "data", buf, "recv")
        return op, (kind, peer, (key, predicted, buf), (expect_shape, expect_dtype, expect_microbatch))

    def _post(self, send_ops: list | None = None, recv: tuple | None = None) -> Any:
        """Post sends and/or one receive's first message in one batch; return the RecvHandle if any."""
        self._reap()
        ops = list(send_ops or [])
        if recv is not None:
            ops.append(recv[0])
        works = self._launch(ops)
        n_send = len(send_ops or [])
        if n_send:
            send_works = [w for per_op in works[:n_send] for w in per_op]
            self._pending_sends.append(_Send(send_works, [op[1] for op in ops[:n_send]]))
        if recv is None:
            return None
        kind, peer, posted, expect = recv[1]
        handle = RecvHandle(self, kind, peer, posted, works[n_send], expect)
        self._recv_queues[kind].append(handle)
        return handle

    def _launch(self, ops: list) -> list:
        """Start ``ops``; return one list of works per op (what to wait on for that op)."""
        if not ops:
            return []
        results: list[list] = [[] for _ in ops]
        remote = []
        for i, (kind, buf, peer, tag, group) in enumerate(ops):
            self.stats["wire_sends" if kind == "send" else "wire_recvs"] += 1
            if peer == self.rank:  # pp_size == 1, or the turn of a V placement: the rank is its own neighbour
                if kind == "send":
                    self._loopback[tag].append(buf.clone())
                else:
                    results[i] = [_LoopbackRecv(self, buf, tag)]
            else:
                remote.append(i)
        if remote:
            p2p = [
                dist.P2POp(dist.isend if ops[i][0] == "send" else dist.irecv, ops[i][1], ops[i][2], ops[i][4], ops[i][3])
                for i in remote
            ]
            works = dist.batch_isend_irecv(p2p)
            if len(works) == len(p2p):
                for i, w in zip(remote, works):
                    results[i] = [w]
            else:  # a coalescing backend returns one work for the whole batch
                for i in remote:
                    results[i] = list(works)
        return results

    def _recv_stream(self, kind: int, peer: int, buf: Tensor, stream: str, what: str) -> None:
        """Receive one message of ``stream`` into ``buf`` and wait for it."""
        if buf.numel() == 0:
            return
        works = self._launch([self._op(kind, peer, stream, buf, "recv")])[0]
        self._wait_works(works, what, keep=[buf])

    def _recv_described(self, kind: int, peer: int, meta: Meta, what: str) -> Tensor:
        """Receive the payload that a header described (all of it, or this rank's slice, then gather)."""
        result = torch.empty(meta.shape, dtype=meta.dtype, device=self.wire)
        if meta.mode == MODE_SCATTER:
            if self.tp_size <= 1 or meta.nbytes % self.tp_size != 0:
                raise RuntimeError(
                    f"pipeline p2p on rank {self.rank}: the {what} was sent scatter-gather, but this rank's "
                    f"tp group has size {self.tp_size} (shape {fmt_shape(meta.shape)}); both stages must use the "
                    f"same tensor-parallel size and scatter_gather setting."
                )
            piece = torch.empty(meta.wire_bytes(self.tp_size), dtype=torch.uint8, device=self.wire)
            self._recv_stream(kind, peer, piece, "full", f"the payload of the {what}")
            self._gather_bytes(piece, _as_bytes(result))
        elif meta.mode == MODE_FULL:
            self._recv_stream(kind, peer, _as_bytes(result), "full", f"the payload of the {what}")
        return result

    def _corrupt(self, kind: int, what: str, values: list[int]) -> RuntimeError:
        return RuntimeError(
            f"pipeline p2p on rank {self.rank}: corrupt or mismatched message in the {what}: expected a "
            f"{_KIND_NAMES[kind]} message, got header/trailer {values}. The two stages' send/receive orders "
            f"disagree (or another component uses the same process group and tags)."
        )

    def _gather_bytes(self, piece: Tensor, out: Tensor) -> None:
        """All-gather every TP rank's ``piece`` into the flat byte tensor ``out`` (rank order)."""
        global _gather_single_ok
        if all_gather_single is not None and _gather_single_ok:
            try:
                all_gather_single(out, piece, group=self.tp_group)
                return
            except NotImplementedError:
                _gather_single_ok = False  # backend without the fused gather: use the list form
        dist.all_gather(list(out.chunk(self.tp_size)), piece, group=self.tp_group)

    def _wait_works(self, works: list, what: str, keep: list[Tensor] = ()) -> None:
        for w in works:
            if w is None:
                continue
            try:
                if self.timeout is None:
                    w.wait()
                else:
                    w.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as err:
                # the transfer may still be posted: its buffers must outlive this communicator's use
                self._abandoned.extend(keep)
                raise RuntimeError(
                    f"pipeline p2p on rank {self.rank} (stage {self.pp_rank}/{self.pp_size}, prev rank "
                    f"{self.prev_rank}, next rank {self.next_rank}): waiting for {what} failed: {err}"
                ) from err

    def _reap(self) -> None:
        """Drop the buffers of sends that have completed."""
        if self._pending_sends:
            self._pending_sends = [s for s in self._pending_sends if not s.done()]
