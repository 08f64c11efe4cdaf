"""Exact resume: random streams per rank and the position in the epoch survive a checkpoint."""
from __future__ import annotations

import logging
import random
from types import SimpleNamespace
from pathlib import Path

import numpy
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from megastrategy.checkpoint.resumable_loader import ResumableLoader
from megastrategy.checkpoint.resume import ExactResume
from megastrategy.errors import CheckpointMismatchError
from megastrategy.checkpoint.rng import capture_rng_states, restore_rng_states
from megastrategy.layers.random import ModelParallelRNGTracker
from tests.helpers.launch import run_script, run_script_to_the_end

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train.py"


class NoisyDataset(Dataset):
    """Each item draws from torch's global generator, as a random augmentation in a worker does."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.rand(1)


def _loader(workers: int) -> DataLoader:
    return DataLoader(NoisyDataset(), batch_size=4, shuffle=True, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "two-workers"])
def test_a_resumed_loader_continues_with_the_next_unseen_batch_in_the_same_order(workers):
    torch.manual_seed(3)
    straight = ResumableLoader(_loader(workers), batches_done=lambda: 4)
    batches = list(straight)
    saved_state, saved_start = straight.state_dict(), straight.epoch_start_rng

    torch.manual_seed(12345)  # the restarted process's generator is somewhere else entirely
    resumed = ResumableLoader(_loader(workers), batches_done=lambda: 0)
    resumed.load_state_dict(saved_state)
    resumed.resume_from(saved_start)
    rest = list(resumed)
    assert saved_state == {"batches_done": 4, "global_batch": 4}
    assert len(rest) == len(batches) - 4
    for (index, noise), (index_ref, noise_ref) in zip(rest, batches[4:]):
        assert torch.equal(index, index_ref)  # the same shuffled order
        if workers:  # a worker's augmentation stream is replayed too (in-process draws are the training's)
            assert torch.equal(noise, noise_ref)
    # Only the resumed epoch is replayed; the next epoch is a fresh, full one.
    assert len(list(resumed)) == len(batches)


def test_without_the_saved_random_state_the_loader_still_skips_the_finished_batches():
    """Another layout has no saved twin of this rank: the position alone must still hold."""
    ordered = lambda: DataLoader(NoisyDataset(), batch_size=4)  # noqa: E731 - a DistributedSampler's order is fixed too
    batches = list(ordered())
    resumed = ResumableLoader(ordered(), batches_done=lambda: 0)
    resumed.load_state_dict({"batches_done": 3, "global_batch": 4})
    rest = list(resumed)
    assert [b[0].tolist() for b in rest] == [b[0].tolist() for b in batches[3:]]


def test_the_global_batch_keeps_the_position_when_dp_changes_and_another_one_is_refused():
    # saved on dp=2 with batch_size 4; resumed on dp=4 with batch_size 2: the same 8 samples per step
    kept = ResumableLoader(DataLoader(NoisyDataset(), batch_size=2), batches_done=lambda: 0, data_parallel=4)
    kept.load_state_dict({"batches_done": 3, "global_batch": 8})
    assert kept.state_dict()["global_batch"] == 8
    other = ResumableLoader(DataLoader(NoisyDataset(), batch_size=4), batches_done=lambda: 0, data_parallel=4)
    with pytest.raises(CheckpointMismatchError, match=r"global batch of 8 samples, but this run's global batch is 16 "
                       r"\(batch_size 4 x dp 4\).*Use batch_size=2 per device \(dp=4\)"):
        other.load_state_dict({"batches_done": 3, "global_batch": 8})
    # at an epoch's end there is no position to keep: any batch size may start the next epoch
    other.load_state_dict({"batches_done": 10, "global_batch": 8})


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(40.0).split(1))


def test_a_stream_without_state_is_not_positioned_and_the_warning_says_what_repeats(caplog):
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(processed=3))))
    loader = DataLoader(Stream(), batch_size=4)
    with caplog.at_level(logging.WARNING, logger="megastrategy.checkpoint.resume"):
        assert ExactResume().wrap_train_loader(loader, SimpleNamespace(fit_loop=loop)) is loader
    assert "IterableDataset (Stream) that has no state_dict/load_state_dict, so it cannot be positioned" in caplog.text
    assert "the 3 batches (12 samples per rank) trained before the checkpoint are seen again" in caplog.text


def test_a_plain_restart_would_repeat_seen_batches():
    """What Lightning does with an ordinary loader (the behaviour the wrapper fixes)."""
    torch.manual_seed(3)
    first = list(_loader(0))
    torch.manual_seed(12345)
    again = list(_loader(0))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(again, first[4:]))


def test_the_wrapper_is_the_loader_for_lightning():
    inner = _loader(0)
    wrapped = ResumableLoader(inner, batches_done=lambda: 0)
    assert len(wrapped) == len(inner) == 10
    assert wrapped.sampler is inner.sampler and wrapped.batch_size == 4 and wrapped.dataset is inner.dataset


def test_what_lightning_sets_on_the_wrapper_reaches_the_loader():
    # Lightning seeds workers by setting ``worker_init_fn`` on the loader it was handed: the wrapper.
    inner = _loader(2)
    wrapped = ResumableLoader(inner, batches_done=lambda: 0)
    seed_workers = lambda worker_id: None  # noqa: E731
    wrapped.worker_init_fn = seed_workers
    assert inner.worker_init_fn is seed_workers and wrapped.worker_init_fn is seed_workers
    wrapped._skip = 3  # the wrapper's own state stays its own
    assert wrapped._skip == 3 and not hasattr(inner, "_skip")


def test_every_random_stream_is_captured_and_restored():
    tracker = ModelParallelRNGTracker(tp_rank=1, device="cpu")
    tracker.seed(7)
    states = capture_rng_states(tracker)
    expected = (torch.rand(3), random.random(), numpy.random.rand(), _draw_on(tracker))
    torch.rand(5), random.random(), numpy.random.rand(), _draw_on(tracker)  # move every stream on
    restore_rng_states(states, tracker)
    again = (torch.rand(3), random.random(), numpy.random.rand(), _draw_on(tracker))
    assert torch.equal(again[0], expected[0]) and again[1:3] == expected[1:3]
    assert torch.equal(again[3], expected[3])


def _draw_on(tracker: ModelParallelRNGTracker) -> torch.Tensor:
    with tracker.fork():
        return torch.rand(2)


# ---------------------------------------------------------------------------------------- end to end
COMMON = ["--model", "bert", "--strategy", "megatron", "--layers", "2", "--tp", "2", "--pp", "2",
          "--dropout", "0.1", "--shuffle", "--n-train", "64", "--steps", "6", "--no-val", "--heartbeat-timeout", "5"]


@pytest.mark.slow
def test_six_steps_straight_equal_three_steps_kill_and_resume_three_at_tp2_pp2(tmp_path):
    """Dropout on (TP-sharded and replicated streams), shuffled data, a checkpoint in the middle
    of the epoch (16 batches per epoch), a SIGKILL, then ``fit(ckpt_path="last")``."""
    straight = run_script(SCRIPT, 4, COMMON, timeout=400)["train_loss"]

    ckpts = tmp_path / "ckpts"
    with_ckpt = COMMON + ["--ckpt-dir", str(ckpts), "--ckpt-every", "3"]
    killed = run_script_to_the_end(SCRIPT, 4, with_ckpt + ["--fail-rank", "3", "--fail-step", "4", "--fail-how", "kill"],
                                   timeout=300)
    assert all(code is not None for code, _, _ in killed), "a rank hung"
    assert killed[3][0] == -9
    assert (ckpts / "last.ckpt" / ".metadata").is_file(), sorted(p.name for p in ckpts.iterdir())

    resumed = run_script(SCRIPT, 4, with_ckpt + ["--resume", "last"], timeout=400)["train_loss"]
    assert len(straight) == 6 and len(resumed) == 3
    assert resumed == straight[3:], (resumed, straight[3:])  # bit-identical, not merely close
