"""A step paused at its model call resumes with the relayed value in its own grad mode, re-raises
its errors in the caller, and unwinds when abandoned."""
import pytest
import torch

import threading

from megastrategy.pipeline.suspended_step import StepThreads, SuspendedStep


def test_a_paused_step_resumes_with_the_value_and_keeps_the_callers_grad_mode():
    seen = []

    def body(step):
        seen.append(("before", torch.is_grad_enabled()))
        value = step.pause(torch.tensor(1.0))
        seen.append(("after", torch.is_grad_enabled()))
        return value * 2

    with torch.no_grad():
        paused = SuspendedStep(body, StepThreads())
        kind, activation = paused.start()
    assert kind == "paused" and activation.item() == 1.0
    assert paused.resume(torch.tensor(5.0)).item() == 10.0
    assert seen == [("before", False), ("after", False)]


def test_errors_reach_the_caller_and_an_abandoned_step_unwinds():
    def failing(step):
        raise ValueError("user code failed")

    with pytest.raises(ValueError, match="user code failed"):
        SuspendedStep(failing, StepThreads()).start()
    unwound = []

    def body(step):
        try:
            step.pause(None)
        finally:
            unwound.append(True)

    paused = SuspendedStep(body, StepThreads())
    paused.start()
    paused.abort()
    assert unwound == [True] and paused._worker.idle.is_set()


def test_worker_threads_are_reused_across_steps():
    threads, names = StepThreads(), []

    def body(step):
        names.append(threading.get_ident())
        return step.pause(None)

    for _ in range(3):  # one step in flight at a time: one thread serves them all
        paused = SuspendedStep(body, threads)
        paused.start()
        paused.resume(1)
    first, second = SuspendedStep(body, threads), SuspendedStep(body, threads)
    first.start(), second.start()  # two in flight: two threads
    first.resume(1), second.resume(2)
    assert len(set(names[:3])) == 1 and names[3] != names[4] and len(set(names)) == 2
