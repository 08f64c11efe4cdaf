"""ContextParallel on real gloo processes against the unsplit model on one process.

For every model the rank checks: the loss equals the single-device loss, its slice of the
output equals the same slice of the single-device output, and every parameter gradient,
averaged over the cp ranks (what the strategy's dp×cp reduction does), equals the
single-device gradient; all within 2e-4 in fp32. All models run in one launch per cp size.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

from tests.context import tiny_models as tm
from tests.helpers.dist import run_distributed

TOL = dict(rtol=2e-4, atol=2e-4)


def _cases():
    return {
        "sdpa_gpt": (tm.SdpaGPT, tm.gpt_batch, tm.gpt_loss),
        "llama_sdpa": (functools.partial(tm.llama, "sdpa"), tm.lm_batch, tm.lm_loss),
        "llama_eager": (functools.partial(tm.llama, "eager"), tm.lm_batch, tm.lm_loss),
        "mistral_window5": (functools.partial(tm.llama, "sdpa", sliding_window=5), tm.lm_batch, tm.lm_loss),
        # no cache: transformers reads the split's global positions (they jump between a rank's chunks) as
        # packed sequences unless the forward context switches that detection off
        "llama_no_cache": (functools.partial(tm.llama, "sdpa", use_cache=False), tm.lm_batch, tm.lm_loss),
        "bert_classifier": (functools.partial(tm.bert, "sdpa", "classifier"),
                            functools.partial(tm.bert_batch, head="classifier"), tm.lm_loss),
        "bert_mlm_eager": (functools.partial(tm.bert, "eager", "mlm"),
                           functools.partial(tm.bert_batch, head="mlm"), tm.lm_loss),
    }


def _check_model(name, build, make_batch, loss_fn, rank, cp):
    from megastrategy.context import ContextParallel

    torch.manual_seed(0)
    reference = build()
    model = copy.deepcopy(reference)
    batch = make_batch(seed=1)
    ref_loss, ref_out = loss_fn(reference, batch)
    ref_loss.backward()

    ContextParallel.validate(model, cp)
    context = ContextParallel(dist.group.WORLD)
    context.apply(model)
    local = context.transform_microbatch(batch, training=True)
    with context.forward_context(local) as state:
        loss, out = loss_fn(model, local)
    loss.backward()

    torch.testing.assert_close(loss, ref_loss, **TOL, msg=f"{name}: loss")
    expected_out = ref_out if context.output == "sequence" else state.layout.split(ref_out, rank)
    torch.testing.assert_close(out, expected_out, **TOL, msg=f"{name}: output")
    for (pname, param), (_, ref_param) in zip(model.named_parameters(), reference.named_parameters()):
        grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / cp, ref_param.grad, **TOL, msg=f"{name}: grad of {pname}")
    context.teardown()
    return _teardown_restores(name, model, reference, batch, loss_fn)


def _teardown_restores(name, model, reference, batch, loss_fn):
    with torch.no_grad():
        torch.testing.assert_close(loss_fn(model, batch)[0], loss_fn(reference, batch)[0], msg=f"{name}: after teardown")
    return True


def _all_models(rank, world_size):
    return {name: _check_model(name, *case, rank, world_size) for name, case in _cases().items()}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_matches_one_device(cp):
    results = run_distributed(_all_models, cp, timeout=240)
    assert all(all(r.values()) for r in results)


def _microbatches_in_flight(rank, world_size):
    from megastrategy.context import ContextParallel

    torch.manual_seed(0)
    model = tm.llama("sdpa").eval()
    batches = [tm.lm_batch(seed) for seed in (3, 4)]
    with torch.no_grad():
        expected = [model(**batch) for batch in batches]
    context = ContextParallel(dist.group.WORLD)
    context.apply(model)
    locals_ = [context.transform_microbatch(batch, training=False) for batch in batches]
    for local, ref in reversed(list(zip(locals_, expected))):  # forward order differs from split order
        with torch.no_grad(), context.forward_context(local):
            out = model(**local)
            whole = context.gather_sequence(out.logits)
        torch.testing.assert_close(out.loss, ref.loss, **TOL)
        torch.testing.assert_close(whole, ref.logits, **TOL)
    context.teardown()
    return True


def test_microbatches_in_flight_and_gathered_outputs():
    assert all(run_distributed(_microbatches_in_flight, 2, timeout=120))
