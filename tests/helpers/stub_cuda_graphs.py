"""A stand-in for ``make_graphed_callables`` on CPU that keeps a real graph's static-buffer semantics.

:class:`StubGraphFn` behaves like ``make_graphed_callables`` where it matters for slots: each
graphed callable owns ONE set of static inputs and outputs and ONE saved autograd state;
a replay copies its inputs into the static inputs, overwrites the static outputs, returns
them (so eager code downstream saves views of them), and replaces the saved state that its
backward will use. Replaying a slot whose microbatch has not run its backward yet therefore
corrupts that microbatch's gradients, exactly as on a GPU. Its backward, like a real graph's,
returns gradients as detached views of ONE set of static gradient buffers per graph.
"""
from __future__ import annotations

import torch

from megastrategy.cuda_graphs import SlotState


class _StubReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphed, *inputs_and_params):
        inputs = inputs_and_params[: len(graphed.static_inputs)]
        with torch.no_grad():
            for s, x in zip(graphed.static_inputs, inputs):
                s.copy_(x)
        with torch.enable_grad():
            ins = [s.detach().requires_grad_(s.requires_grad) for s in graphed.static_inputs]  # alias the buffers
            outs = graphed.callable(*ins)
        graphed.saved = (ins, outs)  # the ONE autograd state of this graph: the next replay replaces it
        with torch.no_grad():
            for s, o in zip(graphed.static_outputs, outs):
                s.copy_(o)
        ctx.graphed = graphed
        result = tuple(s.detach() for s in graphed.static_outputs)  # views of the static outputs
        ctx.mark_non_differentiable(*[r for r in result if not r.is_floating_point()])
        return result

    @staticmethod
    def backward(ctx, *grads):
        graphed = ctx.graphed
        ins, outs = graphed.saved  # whatever the last replay left: wrong if the slot was reused too early
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        wrt = [i for i in ins if i.requires_grad] + list(graphed.params)
        got = torch.autograd.grad(
            [o for o, _ in pairs], wrt, [g if g is not None else torch.zeros_like(o) for o, g in pairs],
            allow_unused=True, retain_graph=True,
        )
        if graphed.static_grads is None:  # like a real graph: ONE set of gradient buffers per graph
            graphed.static_grads = [None if g is None else torch.zeros_like(g) for g in got]
        with torch.no_grad():
            for s, g in zip(graphed.static_grads, got):
                if s is not None:
                    s.copy_(g)
        # returned as detached views of those buffers, as torch's and TE's graphs return them
        it = iter(None if s is None else s.detach() for s in graphed.static_grads)
        in_grads = [next(it) if i.requires_grad else None for i in ins]
        return (None, *in_grads, *it)


class StubGraphed:
    def __init__(self, fn, call, position, callable_, sample):
        self.fn, self.call, self.position = fn, call, position
        self.callable = callable_
        self.static_inputs = list(sample)  # like torch: the sample args ARE the static inputs
        self.params = tuple(p for p in callable_.parameters() if p.requires_grad)
        with torch.enable_grad():  # "capture": run once to get the output buffers
            outs = callable_(*self.static_inputs)
        self.static_outputs = [o.detach().clone() for o in outs]
        self.saved = None
        self.static_grads = None

    def __call__(self, *tensors):
        assert [(t.shape, t.dtype) for t in tensors] == [(s.shape, s.dtype) for s in self.static_inputs]
        self.fn.replays.append((self.call, self.position, self.fn.tracker.current))
        return _StubReplay.apply(self, *tensors, *self.params)


class StubGraphFn:
    """Records (call index, callables, sample shapes); returns :class:`StubGraphed` callables."""

    def __init__(self, tracker=None, fail_on=None):
        self.tracker = tracker
        self.calls: list[tuple[int, list, list]] = []
        self.replays: list[tuple[int, int, SlotState]] = []
        self.fail_on = fail_on

    def __call__(self, callables, sample_args, *, num_warmup_iters, allow_unused_input):
        assert allow_unused_input is True and num_warmup_iters >= 1
        idx = len(self.calls)
        self.calls.append((idx, list(callables), [[tuple(t.shape) for t in s] for s in sample_args]))
        if self.fail_on is not None and any(self.fail_on(c) for c in callables):
            raise RuntimeError("operation not permitted when stream is capturing")
        return tuple(StubGraphed(self, idx, pos, c, s) for pos, (c, s) in enumerate(zip(callables, sample_args)))


def strategy_with_stub_graphs(**kwargs):
    """A ``MegatronStrategy`` whose ``cuda_graph_scope`` runs on CPU with :class:`StubGraphFn`:
    the strategy's wiring (schedule callbacks, warm-up, capture, replay) is exercised end to end;
    only the graphing function and the CUDA device check are replaced."""
    from megastrategy import MegatronStrategy
    from megastrategy.cuda_graphs.component import CudaGraphs

    class StubCudaGraphs(CudaGraphs):
        def check_device(self, device) -> None:
            pass  # graphs run on CPU here, through the stub

        def make_manager(self, module, ctx):
            manager = super().make_manager(module, ctx)
            manager.graph_fn = StubGraphFn(tracker=manager.tracker)
            return manager

    class StubGraphsStrategy(MegatronStrategy):
        def build_components(self, config):
            return [StubCudaGraphs(config) if type(c) is CudaGraphs else c for c in super().build_components(config)]

    return StubGraphsStrategy(**kwargs)
