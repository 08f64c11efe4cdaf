"""Run any per-rank pipeline schedule: forwards, backwards and the messages between them.

The executor knows nothing about the model. For every step of the rank's schedule it
receives what the step needs from the neighbouring stage, calls the caller's
``forward_step`` (or runs autograd for a backward), and sends the result on:

* forward of ``(chunk, microbatch)``: the input is ``None`` on the first virtual stage,
  elsewhere the received activation made a leaf with ``requires_grad=True``; the output
  is the loss on the last virtual stage, elsewhere the activation sent to the next stage;
* backward: ``loss * loss_scale`` is backpropagated on the last virtual stage; elsewhere
  the received output gradient is backpropagated through the stored output, and the
  input's gradient is sent to the previous stage;
* split backward (zero-bubble schedules, :class:`~.schedules.StepPart`): the input-gradient
  step B computes and sends only the input's gradient and keeps what the weight-gradient
  step W needs (:mod:`.split_backward`); W, later, accumulates the parameter gradients.

Which virtual stage (rank ``r``, chunk ``c``) runs is the ``placement``'s (:mod:`.placement`):
by default the ring, stage ``c * pp_size + r``, whose next stage is on rank ``r + 1`` (the first
rank after the last one), so the communicator's ring neighbours serve every chunk. Under another
placement (ZB-V's V) every message names its peer, the rank of the neighbouring stage.

Receives are posted in schedule order, which matches the order in which the neighbour
sends (every rank walks the same microbatch/chunk order), and every message carries its
microbatch id, checked on arrival, so a schedule mismatch fails loudly.

Memory: an output activation is only needed for its ``grad_fn`` once it has been sent,
so its storage is swapped for a one-element buffer expanded to the original shape
("pseudo-free"); ``torch.autograd.backward(out, grad)`` still passes its shape check and
runs the graph from ``out.grad_fn``. Whatever the graph saved itself (e.g. tanh's result)
is unaffected, so gradients are exact. Everything kept for a microbatch is dropped right
after its backward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from megastrategy.pipeline.p2p import PipelineCommunicator, RecvHandle
from megastrategy.pipeline.placement import StagePlacement
from megastrategy.pipeline.schedules import StepPart
from megastrategy.pipeline.split_backward import WeightGradients, backward_input

__all__ = ["PipelineExecutor", "LocalCommunicator"]

ForwardStep = Callable[[int, int, "Tensor | None"], Tensor]
StepCallback = Callable[[int, int], None]  # (chunk, microbatch)


class LocalCommunicator:
    """The communicator of a one-stage schedule (``pp=1``): there is no neighbour to talk to."""

    pp_size = 1
    pp_rank = 0

    def begin_step(self, label: object = "step") -> None:
        pass

    def send_and_irecv(self, *args, **kwargs) -> RecvHandle:
        raise RuntimeError("a one-stage schedule has no neighbouring stage to send to or receive from.")

    def wait_all(self) -> None:
        pass


class PipelineExecutor:
    """Executes a rank's list of :class:`~megastrategy.pipeline.schedules.ScheduleStep`.

    ``overlap_p2p_comm``: post the receive of the next step before computing the current
    one (results are identical; from the second run on the whole predicted message is posted
    early, in the first run only the header, the payload being received when the step needs it). ``deallocate_outputs``: pseudo-free sent activations
    (see the module doc). After :meth:`run`, ``peak_in_flight`` is the most
    (chunk, microbatch) pairs whose forward state was held at once, and ``last_run``
    a dict of counters (``forwards``, ``backwards``, ``weight_steps``, ``freed_bytes``,
    ``peak_in_flight``). ``reuse_saved_gradients``: a W step restarts autograd from the
    gradients its B recorded (``False``: W replays the backward from the output; for measuring).
    """

    def __init__(
        self,
        comm: PipelineCommunicator,
        *,
        pp_size: int,
        pp_rank: int,
        vp_size: int = 1,
        overlap_p2p_comm: bool = False,
        deallocate_outputs: bool = True,
        reuse_saved_gradients: bool = True,
        placement: StagePlacement | None = None,
    ) -> None:
        if pp_size < 1 or not 0 <= pp_rank < pp_size or vp_size < 1:
            raise ValueError(f"bad pipeline coordinates pp_size={pp_size}, pp_rank={pp_rank}, vp_size={vp_size}.")
        if comm.pp_size != pp_size or comm.pp_rank != pp_rank:
            raise ValueError(
                f"the communicator is for stage {comm.pp_rank} of {comm.pp_size}, the executor for stage "
                f"{pp_rank} of {pp_size}."
            )
        self.comm = comm
        self.pp_size = pp_size
        self.pp_rank = pp_rank
        self.vp_size = vp_size
        self.overlap_p2p_comm = overlap_p2p_comm
        self.deallocate_outputs = deallocate_outputs
        self.reuse_saved_gradients = reuse_saved_gradients
        self.placement = placement or StagePlacement.build("ring", pp_size, vp_size)
        if (self.placement.pp_size, self.placement.vp_size) != (pp_size, vp_size):
            raise ValueError(
                f"placement {self.placement.name!r} is for pp_size={self.placement.pp_size}, vp_size="
                f"{self.placement.vp_size}; the executor for pp_size={pp_size}, vp_size={vp_size}."
            )
        self.num_stages = pp_size * vp_size
        self.peak_in_flight = 0
        self.last_run: dict[str, int] = {}

    # ------------------------------------------------------------------------------
    def stage(self, chunk: int) -> int:
        return self.placement.stage(self.pp_rank, chunk)

    def peer(self, chunk: int, direction: str, sending: bool) -> int | None:
        """Pipeline position of the rank a message of ``chunk`` goes to (``sending``) or comes from;
        ``None`` (the communicator's ring neighbour) under the ring placement."""
        if self.placement.name == "ring":
            return None
        downstream = (direction == "forward") == sending  # a forward goes to, a gradient comes from, the next stage
        near = self.placement.next_rank if downstream else self.placement.prev_rank
        return near(self.pp_rank, chunk)

    def is_first_stage(self, chunk: int) -> bool:
        return self.stage(chunk) == 0

    def is_last_stage(self, chunk: int) -> bool:
        return self.stage(chunk) == self.num_stages - 1

    @property
    def holds_last_stage(self) -> bool:
        """Whether this rank runs the last virtual stage (and so returns outputs)."""
        return self.pp_rank == self.placement.last_rank

    def _needed_recv(self, step) -> str | None:
        is_forward, chunk, _, part = step
        if is_forward:
            return None if self.is_first_stage(chunk) else "forward"
        if part is StepPart.WEIGHT:
            return None
        return None if self.is_last_stage(chunk) else "backward"

    def _check_steps(self, steps: Sequence, num_microbatches: int, forward_only: bool) -> list[tuple]:
        """``(is_forward, chunk, microbatch, part)`` per step, after checking that each forward gets
        one whole backward, or an input-gradient step followed by a weight-gradient step."""
        out = []
        done: dict[str, set[tuple[int, int]]] = {"F": set(), StepPart.WHOLE: set(), StepPart.INPUT: set(),
                                                 StepPart.WEIGHT: set()}
        for i, step in enumerate(steps):
            is_forward, chunk, mb = bool(step[0]), int(step[1]), int(step[2])
            part = StepPart(step[3]) if len(step) > 3 else StepPart.WHOLE
            where = f"step {i} {tuple(step)} of the schedule for pp_rank {self.pp_rank}"
            if not 0 <= chunk < self.vp_size:
                raise ValueError(f"{where}: chunk {chunk} is outside [0, {self.vp_size}).")
            if not 0 <= mb < num_microbatches:
                raise ValueError(f"{where}: microbatch {mb} is outside [0, {num_microbatches}).")
            if not is_forward and forward_only:
                raise ValueError(f"{where}: a backward step in a forward_only run.")
            _check_order(where, (chunk, mb), "F" if is_forward else part, done)
            out.append((is_forward, chunk, mb, part))
        if not forward_only:
            finished = done[StepPart.WHOLE] | done[StepPart.WEIGHT]
            if finished != done["F"] or done[StepPart.INPUT] - done[StepPart.WEIGHT]:
                missing = sorted((done["F"] - finished) | (done[StepPart.INPUT] - done[StepPart.WEIGHT]))
                raise ValueError(
                    f"schedule for pp_rank {self.pp_rank}: forwards without a backward (a whole one, or B then W) "
                    f"at (chunk, microbatch) {missing[:8]}."
                )
        return out

    # ------------------------------------------------------------------------------
    def run(
        self,
        steps: Sequence,
        *,
        forward_step: ForwardStep,
        num_microbatches: int,
        forward_only: bool = False,
        loss_scale: float = 1.0,
        on_forward: StepCallback | None = None,
        on_backward: StepCallback | None = None,
        backward_fn: Callable[[Tensor], None] | None = None,
    ) -> list:
        """Run ``steps`` (this rank's schedule); return the last virtual stage's outputs.

        The result is a list indexed by microbatch (losses, detached) on the rank holding
        the last virtual stage, ``[]`` elsewhere. Parameter gradients are accumulated into
        ``.grad`` as ``torch.autograd.backward`` does. An exception raised by
        ``forward_step`` (or autograd) propagates unchanged.

        ``on_forward(chunk, microbatch)`` is called right before each forward step's
        ``forward_step``, and ``on_backward(chunk, microbatch)`` once a backward step is
        complete (its input gradient sent): code that keeps per-microbatch state inside the
        model, such as the static buffers of CUDA graphs (:mod:`megastrategy.cuda_graphs`),
        learns which microbatch is running and when its state may be reused.

        ``backward_fn(loss)`` replaces ``torch.autograd.backward(loss)`` for the last virtual
        stage's (scaled) loss: a one-stage run lets Lightning's own backward do it.
        """
        plan = self._check_steps(steps, num_microbatches, forward_only)
        if backward_fn is not None and any(part is not StepPart.WHOLE for *_, part in plan):
            raise ValueError("backward_fn replaces a whole backward; a split (B/W) schedule runs its own.")
        run = _ScheduleRun(self, plan, num_microbatches, forward_only, loss_scale, backward_fn)
        # message sizes repeat from step to step: the communicator predicts them per step kind
        self.comm.begin_step("forward_only" if forward_only else "train")
        try:
            for i, (is_forward, chunk, mb, part) in enumerate(plan):
                run.post_until(i)  # this step's own receive, unless posted earlier
                if is_forward:
                    run.forward(i, chunk, mb, forward_step, on_forward)
                elif part is StepPart.WEIGHT:
                    run.weight_gradients(chunk, mb)
                else:
                    run.backward(i, chunk, mb, part)
                if not is_forward and part is not StepPart.INPUT and on_backward is not None:
                    on_backward(chunk, mb)
            self.comm.wait_all()
        finally:
            run.close()
        return run.outputs


class _ScheduleRun:
    """The state of one :meth:`PipelineExecutor.run`: posted receives, stored activations, counters."""

    def __init__(self, ex: PipelineExecutor, plan: list, num_microbatches: int, forward_only: bool,
                 loss_scale: float, backward_fn: Callable[[Tensor], None] | None) -> None:
        self.ex, self.comm, self.plan = ex, ex.comm, plan
        self.forward_only, self.loss_scale = forward_only, loss_scale
        self.backward_fn = backward_fn or torch.autograd.backward
        self.outputs: list = [None] * num_microbatches if ex.holds_last_stage else []
        self.stored: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.pending_weights: dict[tuple[int, int], WeightGradients] = {}  # B ran, W not yet
        self.handles: dict[int, RecvHandle] = {}  # step index -> posted receive
        self.recv_needed = [ex._needed_recv(s) for s in plan]
        self.counters = {"forwards": 0, "backwards": 0, "weight_steps": 0, "freed_bytes": 0, "peak_in_flight": 0}
        self.next_to_post = 0  # receives are posted strictly in schedule order
        ex.peak_in_flight = 0

    def post_until(self, limit: int) -> None:
        """Post the receives of steps [next_to_post, limit]."""
        while self.next_to_post <= min(limit, len(self.plan) - 1):
            i = self.next_to_post
            self.next_to_post += 1
            if self.recv_needed[i] is not None:
                self.handles[i] = self.comm.send_and_irecv(None, None, self.recv_needed[i], **self._recv_args(i))

    def _recv_args(self, i: int) -> dict:
        """The keyword arguments of step ``i``'s receive: its microbatch, and its peer off the ring."""
        args = {"expect_microbatch": self.plan[i][2]}
        peer = self.ex.peer(self.plan[i][1], self.recv_needed[i], sending=False)
        return args if peer is None else {**args, "recv_from": peer}

    def send(self, i: int, direction: str, tensor: Tensor, mb: int) -> None:
        """Send; fuse it with the next step's receive when that is not posted yet."""
        j = i + 1
        peer = self.ex.peer(self.plan[i][1], direction, sending=True)
        where = {} if peer is None else {"send_to": peer}
        fuse = not self.ex.overlap_p2p_comm and self.next_to_post == j and j < len(self.plan)
        if fuse and self.recv_needed[j] is not None:
            self.next_to_post = j + 1
            self.handles[j] = self.comm.send_and_irecv(
                direction, tensor, self.recv_needed[j], microbatch=mb, **where, **self._recv_args(j)
            )
        else:
            self.comm.send_and_irecv(direction, tensor, None, microbatch=mb, **where)

    def forward(self, i: int, chunk: int, mb: int, forward_step: ForwardStep, on_forward: StepCallback | None) -> None:
        ex, inp = self.ex, None
        if not ex.is_first_stage(chunk):
            inp = self.handles.pop(i).wait()
            if not self.forward_only:
                inp.requires_grad_(True)
        if ex.overlap_p2p_comm:
            self.post_until(i + 1)
        if on_forward is not None:
            on_forward(chunk, mb)
        with torch.no_grad() if self.forward_only else torch.enable_grad():
            out = forward_step(chunk, mb, inp)
        self.counters["forwards"] += 1
        _check_output(out, chunk, mb, last=ex.is_last_stage(chunk), needs_scalar=not self.forward_only)
        if ex.is_last_stage(chunk):
            self.outputs[mb] = out.detach()
        else:
            self.send(i, "forward", out, mb)
            if not self.forward_only and ex.deallocate_outputs:
                self.counters["freed_bytes"] += _pseudo_free(out)
        if not self.forward_only:
            self.stored[(chunk, mb)] = (inp, out)
            ex.peak_in_flight = max(ex.peak_in_flight, len(self.stored) + len(self.pending_weights))

    def backward(self, i: int, chunk: int, mb: int, part: StepPart) -> None:
        """A whole backward, or (``part=INPUT``) its input-gradient part B; sends the input's gradient."""
        ex = self.ex
        inp, out = self.stored.pop((chunk, mb))
        if ex.is_last_stage(chunk):
            if ex.overlap_p2p_comm:
                self.post_until(i + 1)
            out, grad = (out.reshape(()) if self.loss_scale == 1.0 else out.reshape(()) * self.loss_scale), None
        else:
            grad = self.handles.pop(i).wait()
            if ex.overlap_p2p_comm:
                self.post_until(i + 1)
        if part is StepPart.INPUT:
            self.pending_weights[(chunk, mb)] = backward_input(out, grad, inp,
                                                               reuse_saved_gradients=ex.reuse_saved_gradients)
        elif ex.is_last_stage(chunk):
            self.backward_fn(out)
        elif out.requires_grad:
            torch.autograd.backward(out, grad)
        self.counters["backwards"] += 1
        if not ex.is_first_stage(chunk):
            assert inp is not None
            self.send(i, "backward", inp.grad if inp.grad is not None else torch.zeros_like(inp), mb)

    def weight_gradients(self, chunk: int, mb: int) -> None:
        """W: accumulate the parameter gradients that the microbatch's B left for later."""
        self.pending_weights.pop((chunk, mb)).run()
        self.counters["weight_steps"] += 1

    def close(self) -> None:
        self.stored.clear()
        self.pending_weights.clear()
        self.handles.clear()
        self.counters["peak_in_flight"] = self.ex.peak_in_flight
        self.ex.last_run = self.counters


def _check_order(where: str, key: tuple[int, int], kind, done: dict) -> None:
    """A step may run once, after the steps it needs: F before any backward, B before its W."""
    chunk, mb = key
    if key in done[kind]:
        raise ValueError(f"{where}: runs twice for chunk {chunk}, microbatch {mb}.")
    backward_seen = key in done[StepPart.WHOLE] or key in done[StepPart.INPUT]
    if kind in (StepPart.WHOLE, StepPart.INPUT) and (key not in done["F"] or backward_seen):
        raise ValueError(f"{where}: backward without a preceding forward (or twice).")
    if kind is StepPart.WEIGHT and key not in done[StepPart.INPUT]:
        raise ValueError(f"{where}: weight-gradient step before the input-gradient step of chunk {chunk}, "
                         f"microbatch {mb}.")
    done[kind].add(key)


def _check_output(out: object, chunk: int, mb: int, *, last: bool, needs_scalar: bool) -> None:
    if not isinstance(out, Tensor):
        raise TypeError(
            f"forward_step(chunk={chunk}, microbatch={mb}) returned {type(out).__name__}; it must "
            f"return a Tensor (the loss on the last virtual stage, the activation elsewhere)."
        )
    if last and needs_scalar and out.numel() != 1:
        raise ValueError(
            f"forward_step(chunk={chunk}, microbatch={mb}) on the last virtual stage must return "
            f"the scalar loss; got shape {tuple(out.shape)}."
        )


def _pseudo_free(out: Tensor) -> int:
    """Replace ``out``'s storage by one element expanded to its shape; return bytes released.

    Only for non-leaf, non-view outputs with a ``grad_fn``: a leaf is the caller's tensor, a
    view's storage belongs to its base (nothing would be released).
    """
    if out.grad_fn is None or out._base is not None or out.numel() <= 1:
        return 0
    nbytes = out.numel() * out.element_size()
    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)
    return nbytes
