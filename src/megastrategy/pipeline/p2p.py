"""Point-to-point messages between neighbouring pipeline stages.

Every tensor travels as two messages: a fixed-size int64 *header* (direction, dtype,
shape, transfer mode, microbatch id) and the *payload* (the tensor's bytes). The header
lets the receiver allocate the right buffer, so microbatches of different sequence
lengths and any dtype can flow, and lets it check what it got (a message from the wrong
direction, an unexpected shape or microbatch) with an error instead of a hang or garbage.

Activations (``forward``, to the next stage) and gradients (``backward``, to the previous
stage) use distinct tags, so they cannot be confused even when the previous and the next
stage are the same rank (``pp_size == 2`` with the ring the interleaved schedule needs).
Headers and payloads also have their own tags; within one tag messages between a pair of
ranks are matched first-in first-out, so receives must be posted in the order the peer
sends (the executor posts them in schedule order).

Sends are asynchronous: the communicator keeps every send's buffers alive until its
``Work`` completes (checked on every later call, forced by :meth:`wait_all`), so a caller
may drop or pseudo-free the tensor it sent right away.

Scatter-gather: with a tensor-parallel group of size ``tp > 1`` the activation (and its
gradient) is the same on every TP rank, so each TP rank sends only its ``1/tp`` slice of
the flattened bytes to its counterpart in the neighbouring stage, and the receiving TP
ranks all-gather the slices. Used when the element count is divisible by ``tp``; a plain
full send otherwise (the header says which, so both sides always agree). It must be off
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
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megastrategy.collectives import all_gather_single

__all__ = ["PipelineCommunicator", "RecvHandle", "MAX_NDIM", "HEADER_LEN"]

FORWARD = 0
BACKWARD = 1
_KIND_NAMES = {FORWARD: "activation (forward)", BACKWARD: "gradient (backward)"}

# Tags: one stream per (direction, header/payload). Arbitrary values away from 0, the tag
# plain ``dist.send`` calls use by default.
_TAG_BASE = 0x4D5000
_TAGS = {
    (FORWARD, "hdr"): _TAG_BASE + 1,
    (FORWARD, "data"): _TAG_BASE + 2,
    (BACKWARD, "hdr"): _TAG_BASE + 3,
    (BACKWARD, "data"): _TAG_BASE + 4,
}

_MAGIC = 0x4D53_5050  # "MSPP"
MAX_NDIM = 10
HEADER_LEN = 6 + MAX_NDIM  # magic, kind, dtype code, ndim, mode, microbatch, dims...

_MODE_FULL = 0  # whole tensor in one payload
_MODE_SCATTER = 1  # each TP rank sends 1/tp of the bytes; receivers all-gather
_MODE_EMPTY = 2  # numel == 0: header only

_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype) and _dt not in _DTYPES:
        _DTYPES.append(_dt)
_DTYPE_CODES = {dt: i for i, dt in enumerate(_DTYPES)}

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


def _fmt_shape(shape: Sequence[int] | None) -> str:
    return "None" if shape is None else "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


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
    """A posted receive: the header is on its way; :meth:`wait` returns the tensor.

    Handles of one direction complete in the order they were posted (waiting on a later
    one first completes the earlier ones), which keeps the first-in first-out matching of
    headers and payloads intact.
    """

    def __init__(
        self,
        comm: "PipelineCommunicator",
        kind: int,
        peer: int,
        header: Tensor,
        header_works: list,
        expect_shape: Sequence[int] | None,
        expect_dtype: torch.dtype | None,
        expect_microbatch: int | None,
    ) -> None:
        self._comm = comm
        self.kind = kind
        self.peer = peer
        self._header = header
        self._header_works = header_works
        self._expect_shape = None if expect_shape is None else tuple(int(d) for d in expect_shape)
        self._expect_dtype = expect_dtype
        self._expect_microbatch = expect_microbatch
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
        comm._wait_works(self._header_works, f"the header of the {what}", keep=[self._header])
        hdr = [int(v) for v in self._header.tolist()]
        self._header = None  # type: ignore[assignment]
        magic, kind, code, ndim, mode, microbatch = hdr[:6]
        if (
            magic != _MAGIC
            or kind != self.kind
            or not 0 <= ndim <= MAX_NDIM
            or not 0 <= code < len(_DTYPES)
            or mode not in (_MODE_FULL, _MODE_SCATTER, _MODE_EMPTY)
        ):
            raise RuntimeError(
                f"pipeline p2p on rank {comm.rank}: corrupt or mismatched header in the {what}: expected a "
                f"{_KIND_NAMES[self.kind]} message, got header {hdr}. The two stages' send/receive orders disagree "
                f"(or another component uses the same process group and tags)."
            )
        shape = tuple(hdr[6 : 6 + ndim])
        dtype = _DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize

        # receive the payload before any check, so that a mismatch leaves both sides in step
        result = torch.empty(shape, dtype=dtype, device=comm.wire)
        if mode == _MODE_SCATTER:
            if comm.tp_size <= 1 or nbytes % comm.tp_size != 0:
                raise RuntimeError(
                    f"pipeline p2p on rank {comm.rank}: the {what} was sent scatter-gather, but this rank's "
                    f"tp group has size {comm.tp_size} (shape {_fmt_shape(shape)}); both stages must use the "
                    f"same tensor-parallel size and scatter_gather setting."
                )
            piece = torch.empty(nbytes // comm.tp_size, dtype=torch.uint8, device=comm.wire)
            comm._recv_payload(self.kind, self.peer, piece, what)
            if not self._mismatch(shape, dtype, microbatch):
                comm._gather_bytes(piece, _as_bytes(result))
        elif mode == _MODE_FULL:
            comm._recv_payload(self.kind, self.peer, _as_bytes(result), what)

        problem = self._mismatch(shape, dtype, microbatch)
        if problem:
            raise RuntimeError(f"pipeline p2p on rank {comm.rank}: {what}: {problem}")
        return result.to(comm.device)

    def _mismatch(self, shape: tuple[int, ...], dtype: torch.dtype, microbatch: int) -> str:
        shape_bad = self._expect_shape is not None and shape != self._expect_shape
        dtype_bad = self._expect_dtype is not None and dtype != self._expect_dtype
        if shape_bad or dtype_bad:
            expected_shape = "any shape" if self._expect_shape is None else f"shape {_fmt_shape(self._expect_shape)}"
            expected_dtype = "any dtype" if self._expect_dtype is None else f"dtype {self._expect_dtype}"
            return (
                f"expected {expected_shape} {expected_dtype}, received shape {_fmt_shape(shape)} dtype {dtype}"
                + (f" (microbatch {microbatch})" if microbatch >= 0 else "")
                + "."
            )
        if self._expect_microbatch is not None and microbatch >= 0 and microbatch != self._expect_microbatch:
            return (
                f"expected the message of microbatch {self._expect_microbatch}, received microbatch {microbatch} "
                f"(shape {_fmt_shape(shape)} {dtype}); the two stages run different schedules."
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
    bytes, i.e. the ``1/tp`` slice under scatter-gather), ``header_bytes``, and
    ``scatter_gather`` (tensors sent as slices).
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
        self.stats: dict[str, int] = {"messages": 0, "bytes": 0, "header_bytes": 0, "scatter_gather": 0}
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

    def _header_for(self, kind: int, tensor: Tensor, mode: int, microbatch: int) -> Tensor:
        if tensor.dim() > MAX_NDIM:
            raise ValueError(
                f"pipeline p2p can send tensors of at most {MAX_NDIM} dimensions; got shape "
                f"{_fmt_shape(tensor.shape)}. Reshape the activation before it crosses a stage boundary."
            )
        code = _DTYPE_CODES.get(tensor.dtype)
        if code is None:
            raise TypeError(f"pipeline p2p cannot send dtype {tensor.dtype} (supported: {_DTYPES}).")
        values = [_MAGIC, kind, code, tensor.dim(), mode, int(microbatch)] + list(tensor.shape)
        values += [0] * (HEADER_LEN - len(values))
        return torch.tensor(values, dtype=torch.int64, device=self.wire)

    def _send_ops(
        self, kind: int, tensor: Tensor, microbatch: int, peer: int | None = None
    ) -> list[tuple[str, Tensor, int, int, Any]]:
        """(op, buffer, peer, tag, group) tuples sending ``tensor`` in direction ``kind``
        (to ``peer``, a global rank, or by default the direction's ring neighbour)."""
        if not isinstance(tensor, Tensor):
            raise TypeError(f"pipeline p2p can only send tensors, got {type(tensor).__name__}.")
        if peer is None:
            peer = self.next_rank if kind == FORWARD else self.prev_rank
        group = self._group(kind)
        tensor = tensor.detach()
        if tensor.device != self.wire:
            tensor = tensor.to(self.wire)
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.numel() == 0:
            mode = _MODE_EMPTY
        elif self.scatter_gather and self.tp_size > 1 and peer != self.rank and tensor.numel() % self.tp_size == 0:
            mode = _MODE_SCATTER
        else:
            mode = _MODE_FULL
        header = self._header_for(kind, tensor, mode, microbatch)
        ops = [("send", header, peer, _TAGS[(kind, "hdr")], group)]
        if mode != _MODE_EMPTY:
            payload = _as_bytes(tensor)
            if mode == _MODE_SCATTER:
                piece = nbytes // self.tp_size
                payload = payload[self.tp_rank * piece : (self.tp_rank + 1) * piece]
                self.stats["scatter_gather"] += 1
            ops.append(("send", payload, peer, _TAGS[(kind, "data")], group))
            self.stats["bytes"] += payload.numel()
        self.stats["messages"] += 1
        self.stats["header_bytes"] += header.numel() * header.element_size()
        return ops

    def _recv_op(self, kind, expect_shape, expect_dtype, expect_microbatch, peer: int | None = None):
        if peer is None:
            peer = self.prev_rank if kind == FORWARD else self.next_rank
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.wire)
        op = ("recv", header, peer, _TAGS[(kind, "hdr")], self._group(kind))
        return op, (kind, peer, header, expect_shape, expect_dtype, expect_microbatch)

    def _post(self, send_ops: list | None = None, recv: tuple | None = None) -> Any:
        """Post sends and/or one header receive in one batch; return the RecvHandle if any."""
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
        kind, peer, header, expect_shape, expect_dtype, expect_microbatch = recv[1]
        handle = RecvHandle(self, kind, peer, header, works[n_send], expect_shape, expect_dtype, expect_microbatch)
        self._recv_queues[kind].append(handle)
        return handle

    def _launch(self, ops: list) -> list:
        """Start ``ops``; return one list of works per op (what to wait on for that op)."""
        if not ops:
            return []
        results: list[list] = [[] for _ in ops]
        remote = []
        for i, (kind, buf, peer, tag, group) in enumerate(ops):
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

    def _recv_payload(self, kind: int, peer: int, buf: Tensor, what: str) -> None:
        if buf.numel() == 0:
            return
        works = self._launch([("recv", buf, peer, _TAGS[(kind, "data")], self._group(kind))])[0]
        self._wait_works(works, f"the payload of the {what}", keep=[buf])

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
