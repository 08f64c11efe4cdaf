"""TokenMeans on one process: microbatch losses whose average is the whole batch's token mean."""
import logging

import pytest
import torch
import torch.nn.functional as F

from megastrategy.pipeline.token_means import TokenMeans

B, T, V, M = 8, 6, 11, 4


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.6] = -100
    labels[0, :] = 7  # the first microbatch holds more valid tokens than the others
    return logits, labels


def _masked_lm(logits, labels, **kw):
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), **kw)


def _hf_causal(logits, labels, **kw):  # what transformers' causal LM loss does with labels=
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, V), shifted.reshape(-1), ignore_index=-100, **kw)


def _hand_shifted(logits, labels, **kw):
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), **kw)


def _nll(logits, labels, **kw):
    return F.nll_loss(logits.log_softmax(-1).reshape(-1, V), labels.reshape(-1), **kw)


def _per_microbatch(loss_fn, logits, labels, token_means=None, batches=None, **kw):
    batches = batches or [{"input_ids": torch.zeros_like(lab), "labels": lab} for lab in labels.chunk(M)]
    outs = []
    for k, (lg, mb) in enumerate(zip(logits.chunk(M), batches)):
        if token_means is None:
            outs.append(loss_fn(lg, mb["labels"], **kw))
            continue
        with token_means.microbatch(k):
            outs.append(loss_fn(lg, mb["labels"], **kw))
    return sum(outs) / M, batches


_WEIGHT = {"weight": torch.linspace(0.5, 2.0, V)}
_CASES = [(fn, kw) for fn in (_masked_lm, _hf_causal, _hand_shifted, _nll) for kw in ({}, _WEIGHT, {"label_smoothing": 0.1})
          if not (fn is _nll and kw.get("label_smoothing"))]  # nll_loss has no label smoothing


@pytest.mark.parametrize("loss_fn, kw", _CASES, ids=[f"{fn.__name__[1:]}-{'-'.join(kw) or 'plain'}" for fn, kw in _CASES])
def test_the_average_of_microbatch_losses_is_the_batchs_mean(data, loss_fn, kw):
    logits, labels = data
    whole = loss_fn(logits, labels, **kw)
    naive, batches = _per_microbatch(loss_fn, logits, labels, **kw)
    assert abs(naive - whole) > 1e-3  # the plain average of microbatch means is not the batch's mean
    tm = TokenMeans()
    with tm.step("training_step", batches):
        fixed, _ = _per_microbatch(loss_fn, logits, labels, tm, batches, **kw)
    assert fixed == pytest.approx(float(whole), abs=1e-6)


def test_the_gradient_is_the_batchs(data):
    logits, labels = data
    whole_logits = logits.clone().requires_grad_(True)
    _hf_causal(whole_logits, labels).backward()
    micro_logits = logits.clone().requires_grad_(True)
    tm = TokenMeans()
    batches = [{"labels": lab} for lab in labels.chunk(M)]
    with tm.step("training_step", batches):
        loss, _ = _per_microbatch(_hf_causal, micro_logits, labels, tm, batches)
    loss.backward()
    torch.testing.assert_close(micro_logits.grad, whole_logits.grad)


def test_equal_counts_and_other_reductions_are_left_alone(data):
    logits, labels = data
    full = torch.randint(0, V, (B, T))  # no ignored label: every microbatch holds the same count
    tm = TokenMeans()
    batches = [{"labels": lab} for lab in full.chunk(M)]
    with tm.step("training_step", batches):
        with tm.microbatch(1):
            same = _masked_lm(logits.chunk(M)[1], batches[1]["labels"])
            summed = _masked_lm(logits.chunk(M)[1], batches[1]["labels"], reduction="sum")
            soft = F.cross_entropy(logits.chunk(M)[1].reshape(-1, V), torch.rand(2 * T, V))
    assert torch.equal(same, _masked_lm(logits.chunk(M)[1], batches[1]["labels"]))
    assert torch.equal(summed, _masked_lm(logits.chunk(M)[1], batches[1]["labels"], reduction="sum"))
    assert soft.isfinite()


def test_outside_a_microbatch_and_after_the_step_the_losses_are_torchs(data):
    logits, labels = data
    original = F.cross_entropy
    tm = TokenMeans()
    with tm.step("training_step", [{"labels": lab} for lab in labels.chunk(M)]):
        assert F.cross_entropy is not original
        outside = _masked_lm(logits[:2], labels[:2])
    assert F.cross_entropy is original and F.nll_loss.__module__ == "torch.nn.functional"
    assert torch.equal(outside, _masked_lm(logits[:2], labels[:2]))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megastrategy.pipeline.token_means"]


def test_targets_built_inside_the_step_are_left_alone_and_warned_about_once(data, caplog):
    logits, labels = data
    tm = TokenMeans()
    batches = [{"labels": lab} for lab in labels.chunk(M)]

    def derived(lg, lab):  # the step builds its targets: no tensor of the batch gives them
        return _masked_lm(lg, torch.where(lab == -100, -100, (lab + 1) % V))

    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with tm.step("training_step", batches):
                loss, _ = _per_microbatch(derived, logits, labels, tm, batches)
    assert loss == pytest.approx(float(_per_microbatch(derived, logits, labels)[0]))
    (warning,) = _warnings(caplog)
    assert "[9, 8, 2, 7]" in warning and "num_microbatches=1" in warning


def test_targets_equal_to_the_batchs_in_one_microbatch_only_are_reported(data, caplog):
    logits, labels = data
    tm = TokenMeans()
    batches = [{"labels": lab} for lab in labels.chunk(M)]

    def derived(lg, lab):  # equal to the batch's labels in microbatch 0 (no 3 there), not after
        return _masked_lm(lg, torch.where(lab == 3, -100, lab))

    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with tm.step("training_step", batches):
                second, _ = _per_microbatch(derived, logits, labels, tm, batches)
    assert second == pytest.approx(float(_per_microbatch(derived, logits, labels)[0]))  # no longer rewritten
    (warning,) = _warnings(caplog)
    assert "in some microbatches and not in others" in warning
