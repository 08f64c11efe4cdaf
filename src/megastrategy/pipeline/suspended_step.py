"""Pause a stage's run of the user's step at its model call, and finish it after the relay.

On a stage before the last, the user's step reaches the model call during the schedule, but what
the model returns only exists once the last stage has run that microbatch. Running the step again
from the start would run the lines before the model call twice (an append to a list, a metric
update with the batch). So the step runs in a thread of its own that pauses at the model call
(:mod:`.model_calls`), hands the stage's boundary activation to the schedule, and is resumed with
the relayed output after the schedule. The two threads strictly alternate (one waits while the
other runs), and the step's thread starts with the caller's grad mode, autocast and CUDA device and
stream, which are per thread in torch. Threads are kept and reused (:class:`StepThreads`): a new
thread per microbatch starts with a cold allocator arena, and the stage's forward then runs slower.
"""
from __future__ import annotations

import queue
import threading
from contextlib import ExitStack
from typing import Any, Callable

import torch

__all__ = ["StepAborted", "StepThreads", "SuspendedStep"]


class StepAborted(BaseException):
    """Raised inside a paused step whose run was abandoned (another rank or microbatch failed)."""


class StepThreads:
    """Worker threads for paused steps, reused across microbatches and steps (one per step in flight)."""

    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> "_Worker":
        """Start ``job`` on an idle worker (a new one if none is idle); the worker is idle again after it."""
        with self._lock:
            worker = self._idle.pop() if self._idle else _Worker(self)
        worker.submit(job)
        return worker

    def _release(self, worker: "_Worker") -> None:
        with self._lock:
            self._idle.append(worker)


class _Worker:
    def __init__(self, pool: StepThreads) -> None:
        self._pool, self._jobs = pool, queue.SimpleQueue()
        self.idle = threading.Event()  # set once a job has ended and the worker is back in the pool
        threading.Thread(target=self._loop, daemon=True, name="megastrategy-step").start()

    def submit(self, job: Callable[[], None]) -> None:
        self.idle.clear()
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            finally:
                self._pool._release(self)
                self.idle.set()


class SuspendedStep:
    """One microbatch's run of the user's step, on a worker thread (see the module docstring)."""

    def __init__(self, body: Callable[["SuspendedStep"], Any], threads: StepThreads) -> None:
        self._to_main: queue.SimpleQueue = queue.SimpleQueue()
        self._to_step: queue.SimpleQueue = queue.SimpleQueue()
        self._state = _thread_state()
        self._body, self._threads = body, threads
        self._worker: "_Worker | None" = None

    def start(self) -> tuple[str, Any]:
        """Run until the step pauses (``("paused", activation)``) or ends (``("done", output)``)."""
        self._worker = self._threads.run(lambda: self._run(self._body))
        return self._wait()

    def pause(self, value: Any) -> Any:
        """Inside the step: hand ``value`` to the caller and wait for what to go on with."""
        self._to_main.put(("paused", value))
        kind, payload = self._to_step.get()
        if kind == "abort":
            raise StepAborted()
        return payload

    def resume(self, payload: Any) -> Any:
        """Go on with the paused step; returns the step's output."""
        self._to_step.put(("resume", payload))
        kind, value = self._wait()
        if kind != "done":
            raise RuntimeError("the user's step paused twice; a step may make one model call that reaches the stack.")
        return value

    def abort(self) -> None:
        """Unwind a paused step (its run ends with :class:`StepAborted`)."""
        if self._worker is not None and not self._worker.idle.is_set():
            self._to_step.put(("abort", None))
            self._worker.idle.wait(timeout=60)

    def _wait(self) -> tuple[str, Any]:
        kind, value = self._to_main.get()
        if kind != "paused":
            self._worker.idle.wait()  # the run has ended: its worker is free for the next step
        if kind == "error":
            raise value
        return kind, value

    def _run(self, body: Callable[["SuspendedStep"], Any]) -> None:
        try:
            with _entered(self._state):
                result = body(self)
        except StepAborted:
            return
        except BaseException as error:  # noqa: BLE001 - the caller's thread re-raises it
            self._to_main.put(("error", error))
            return
        self._to_main.put(("done", result))


def _thread_state() -> dict[str, Any]:
    state: dict[str, Any] = {"grad": torch.is_grad_enabled(), "autocast": {}}
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            state["autocast"][device] = torch.get_autocast_dtype(device)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = (torch.cuda.current_device(), torch.cuda.current_stream())
    return state


def _entered(state: dict[str, Any]) -> ExitStack:
    stack = ExitStack()
    stack.enter_context(torch.set_grad_enabled(state["grad"]))
    for device, dtype in state["autocast"].items():
        stack.enter_context(torch.autocast(device, dtype=dtype))
    if "cuda" in state:
        device, stream = state["cuda"]
        torch.cuda.set_device(device)
        stack.enter_context(torch.cuda.stream(stream))
    return stack
