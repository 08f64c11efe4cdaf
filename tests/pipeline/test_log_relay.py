"""Per-microbatch ``self.log`` calls combine into the whole batch's value by the call's
``reduce_fx``, and are replayed once on the module's device (NCCL's ``sync_dist`` needs it)."""
import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.log_reduce import combine_microbatches, microbatch_size
from megastrategy.pipeline.log_relay import _LogCapture, replay_logs


def test_each_reduction_gives_the_whole_batch_value():
    batch = torch.tensor([1.0, 5.0, 2.0, 2.0, 7.0, 0.0])
    halves = [(batch[:2], 2), (batch[2:], 4)]  # unequal sizes, as with batch_size=<token count>
    assert combine_microbatches("x", [(float(b.mean()), n) for b, n in halves], "mean") == (pytest.approx(float(batch.mean())), 6)
    assert combine_microbatches("x", [(float(b.sum()), n) for b, n in halves], "sum") == (float(batch.sum()), 6)
    assert combine_microbatches("x", [(float(b.max()), n) for b, n in halves], torch.max)[0] == 7.0
    assert combine_microbatches("x", [(float(b.min()), n) for b, n in halves], "min")[0] == 0.0
    with pytest.raises(MegatronConfigError, match="reduce_fx"):
        combine_microbatches("x", [(1.0, 1)], torch.median)


def test_capture_weights_by_inferred_or_given_batch_size():
    capture = _LogCapture({})
    for mb in (torch.ones(2, 3), torch.ones(6, 3)):
        capture.begin_microbatch({"ids": mb})
        capture("loss", torch.tensor(float(len(mb))))  # weight = inferred size
        capture("tok", torch.tensor(1.0), batch_size=10 if len(mb) == 2 else 30)
    logs = {name: (value, kw["batch_size"]) for name, value, kw in capture.combined()}
    assert logs["loss"] == (pytest.approx((2 * 2 + 6 * 6) / 8), 8)
    assert logs["tok"] == (pytest.approx(1.0), 40)
    assert microbatch_size({"ids": torch.ones(5, 2)}) == 5


class _FakeModule:
    device = torch.device("meta")

    def __init__(self):
        self.logged = []

    def log(self, name, value, **kwargs):
        self.logged.append((name, value.device.type, value.dtype, kwargs))


def test_replayed_values_are_on_the_module_device_and_dropped_calls_do_not_count():
    capture = _LogCapture({})
    for mb in range(2):
        capture.begin_microbatch(torch.ones(2, 1), keep=False)  # a stage's share of the forward
        capture("s", torch.tensor(100.0), reduce_fx="sum")
        capture.begin_microbatch(torch.ones(2, 1))
        capture("s", torch.tensor(float(mb + 1)), reduce_fx="sum", sync_dist=True, sync_dist_group="g")
    module = _FakeModule()
    replay_logs(module, capture)
    assert module.logged == [("s", "meta", torch.float32, {"reduce_fx": "sum", "sync_dist": True,
                                                           "sync_dist_group": "g", "batch_size": 4})]
