"""Under pipeline parallelism the user's whole step runs on every rank, with one device's values.

Transport: what a model returns (tensors, tuples, dicts, Hugging Face ``ModelOutput``s) arrives
intact on every rank of the pipeline group, and its structure travels once while it stays the same.

Lightning: one launch per layout of ``tests/scripts/tutorial_module.py`` (Lightning's GLUE tutorial
module on a tiny ``BertForSequenceClassification``) against ``DDPStrategy`` from the same seed: the
epoch-end ``val_loss``/accuracy built from ``self.outputs``, a torchmetrics accuracy, ``self.all_gather``
at epoch end, and the outputs ``on_*_batch_end``/``trainer.predict`` receive, on every rank.
"""
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megastrategy.pipeline.output_relay import OutputRelay
from megastrategy.tree_broadcast import HEADER_SLOTS
from tests.helpers.dist import run_distributed
from tests.helpers.launch import run_script

SCRIPT = Path(__file__).parents[1] / "scripts" / "tutorial_module.py"
TOL = 2e-4
LAYOUTS = {  # name: (processes, DDP processes with the same data-parallel size, strategy arguments)
    "pp2": (2, 1, ("--pp", "2")),
    "tp2-pp2": (4, 1, ("--tp", "2", "--pp", "2")),
    "pp2-vp2": (2, 1, ("--pp", "2", "--vp", "2")),
    "pp2-dp2": (4, 2, ("--pp", "2")),
}


def _model_outputs():
    from transformers.modeling_outputs import SequenceClassifierOutput

    first = [SequenceClassifierOutput(loss=torch.tensor(0.5), logits=torch.arange(6.0).reshape(3, 2))]
    second = [(torch.ones(2, dtype=torch.int64), {"n": 3, "mask": torch.tensor([True, False])})]
    return [first, second]


def _arrived_intact(got) -> bool:
    from transformers.modeling_outputs import SequenceClassifierOutput

    expected = _model_outputs()
    (out,), ((ids, extra),) = got
    return (type(out) is SequenceClassifierOutput and list(out.keys()) == ["loss", "logits"]
            and torch.equal(out.loss, expected[0][0].loss) and torch.equal(out[1], expected[0][0].logits)
            and torch.equal(ids, expected[1][0][0]) and extra["n"] == 3 and torch.equal(extra["mask"], expected[1][0][1]["mask"]))


def _relay(rank, world):
    relay = OutputRelay(group=None, src=world - 1, device=torch.device("cpu"))
    pickled, broadcast_object_list = [], dist.broadcast_object_list

    def counting(*args, **kwargs):
        pickled.append(1)
        return broadcast_object_list(*args, **kwargs)

    dist.broadcast_object_list = counting  # this worker process only
    intact, sizes = [], []
    for step in range(3):  # the same structure three times: pickled once
        intact.append(_arrived_intact(relay.relay(_model_outputs() if rank == world - 1 else None)))
        sizes.append(relay.last_bytes)
    return intact, sizes, len(pickled)  # plain values: tensors would outlive the worker's queue


@pytest.mark.slow
def test_model_outputs_arrive_intact_and_the_structure_travels_once():
    for intact, sizes, pickled in run_distributed(_relay, 2, timeout=90):
        assert intact == [True] * 3 and pickled == 1
        payload = 16 + 32 + 16 + 16  # loss, logits, ids, mask, each at a 16-byte aligned offset
        assert sizes == [payload + 8 * HEADER_SLOTS] * 3  # the header fits in its one message


@lru_cache(maxsize=None)
def _run(nprocs: int, *args: str) -> dict:
    return run_script(SCRIPT, nprocs, list(args), timeout=400)["ranks"]


def _layouts(layout: str) -> tuple[list, list]:
    nprocs, ddp_procs, args = LAYOUTS[layout]
    return _run(nprocs, "--strategy", "megatron", *args), _run(ddp_procs, "--strategy", "ddp")


def _assert_close(mine, theirs, where: str) -> None:
    """Same structure (container types and keys included), numbers within TOL."""
    assert type(mine) is type(theirs) or {type(mine), type(theirs)} <= {int, float}, (where, mine, theirs)
    if isinstance(theirs, dict):
        assert mine.keys() == theirs.keys(), (where, sorted(mine), sorted(theirs))
        for k in theirs:
            _assert_close(mine[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list):
        assert len(mine) == len(theirs), (where, len(mine), len(theirs))
        for i, (a, b) in enumerate(zip(mine, theirs)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert abs(mine - theirs) <= TOL * max(1.0, abs(theirs)), (where, mine, theirs)
    else:
        assert mine == theirs, (where, mine, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_epoch_end_metrics_from_outputs_and_torchmetrics_match_ddp(layout):
    ours, ddp = _layouts(layout)
    assert {"val_loss", "accuracy", "tm_accuracy"} <= ddp[0]["epoch_metrics"][-1].keys()
    for rank, rec in enumerate(ours):  # every rank, not only the last stage; DDP's rank of the same replica
        reference = ddp[rec["replica"]]
        _assert_close(rec["epoch_metrics"], reference["epoch_metrics"], f"rank {rank} epoch metrics")
        _assert_close(rec["train_metrics"], reference["train_metrics"], f"rank {rank} step metrics")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_all_gather_at_epoch_end_sees_every_example_once(layout):
    ours, ddp = _layouts(layout)
    assert len(ddp[0]["gathered"]) == 2 and len(ddp[0]["gathered"][0]) == 16
    for rank, rec in enumerate(ours):
        assert rec["gathered"] == ddp[0]["gathered"], f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "tp2-pp2", "pp2-dp2"])
def test_lines_before_the_model_call_run_once_per_example_on_every_rank(layout):
    """Stages before the last pause the step at the model call instead of running it twice
    (with vp > 1 a rank's earlier chunks repeat them: documented)."""
    ours, ddp = _layouts(layout)
    for rank, rec in enumerate(ours):
        assert sum(rec["seen_before_forward"]) == sum(ddp[rec["replica"]]["seen_before_forward"]) > 0, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name, (_, dp, _) in LAYOUTS.items() if dp == 1])
def test_step_outputs_are_the_whole_batch_as_one_device_returns_them(layout):
    ours, ddp = _layouts(layout)
    reference = ddp[0]
    assert reference["train_outputs"][0].keys() == {"type", "loss", "correct", "logits"}  # extra keys kept
    assert reference["predictions"][0]["type"] == "SequenceClassifierOutput"
    for rank, rec in enumerate(ours):
        for key in ("train_outputs", "val_outputs", "test_outputs", "predictions"):
            _assert_close(rec[key], reference[key], f"rank {rank} {key}")
