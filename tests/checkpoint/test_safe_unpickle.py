"""A checkpoint is data, not code: a pickle in it that would run code is refused, by name, and
never executed, on every path that reads a checkpoint."""
from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict

from megastrategy.checkpoint import consolidate, read_info, read_lightning_metadata, save_sharded
from megastrategy.checkpoint.rng import capture_rng_states, restore_rng_states
from megastrategy.checkpoint.sharded import read_rank_state
from megastrategy.cli import main as cli
from megastrategy.errors import UnsafeCheckpointError


class CreatesAFile:
    """What an attacker puts in a checkpoint: unpickling it runs a shell command."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return os.system, (f"touch {self.target}",)


@dataclass
class UserConfig:
    width: int = 32


def _save(path: Path, lightning: dict) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    with pytest.warns(UserWarning, match="single process"):  # DCP without a process group says so
        save_sharded(path, module=model, optimizers=[opt], lightning=lightning, rank_state={"rng": capture_rng_states()})


def test_an_ordinary_checkpoint_reads_back_as_data(tmp_path):
    _save(tmp_path / "ok", {"epoch": 1, "hyper_parameters": AttributeDict(lr=0.1), "loops": {"step": torch.tensor(3)}})
    meta = read_lightning_metadata(tmp_path / "ok")
    assert meta["hyper_parameters"] == {"lr": 0.1} and meta["loops"]["step"].item() == 3
    assert set(consolidate(tmp_path / "ok")) == {"weight", "bias"}
    assert cli(["info", str(tmp_path / "ok")]) == 0
    restore_rng_states(read_rank_state(tmp_path / "ok", 0)["rng"])  # numpy's state is stored as tensors


def test_a_metadata_pickle_that_would_run_code_is_refused_by_name_and_never_runs(tmp_path):
    _save(tmp_path / "ckpt", {"epoch": 0})
    target = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(CreatesAFile(target)))
    for read in (read_info, consolidate, read_lightning_metadata, lambda p: cli(["info", str(p)]),
                 lambda p: cli(["consolidate", str(p), str(tmp_path / "out.pt")])):
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata names the type posix\.system.*nothing was loaded"):
            read(tmp_path / "ckpt")
    assert not target.exists()


def test_a_byte_item_that_would_run_code_is_refused_by_name_and_never_runs(tmp_path):
    target = tmp_path / "pwned"
    _save(tmp_path / "ckpt", {"epoch": 0, "callbacks": {"evil": CreatesAFile(target)}})
    assert not target.exists()  # saving pickles it, which runs nothing
    read_info(tmp_path / "ckpt")  # the metadata and the other items are fine
    with pytest.raises(UnsafeCheckpointError, match=r"the item 'meta/lightning' names the type posix\.system"):
        read_lightning_metadata(tmp_path / "ckpt")
    assert not target.exists()


def test_a_type_the_user_trusts_is_admitted_with_torchs_own_allow_list(tmp_path):
    _save(tmp_path / "ckpt", {"hyper_parameters": {"config": UserConfig(64)}})
    with pytest.raises(UnsafeCheckpointError, match=r"UserConfig.*add_safe_globals\(\[.*UserConfig\]\)"):
        read_lightning_metadata(tmp_path / "ckpt")
    with torch.serialization.safe_globals([UserConfig]):
        assert read_lightning_metadata(tmp_path / "ckpt")["hyper_parameters"]["config"] == UserConfig(64)


def test_a_checkpoint_written_before_states_were_plain_data_still_resumes(tmp_path):
    """Earlier versions stored NumPy's RNG state as its tuple with an ndarray: numeric arrays are data."""
    import numpy

    model = torch.nn.Linear(3, 2)
    numpy.random.seed(4)
    legacy = {"rng": {"numpy": numpy.random.get_state()}}
    expected = numpy.random.rand()
    with pytest.warns(UserWarning, match="single process"):
        save_sharded(tmp_path / "old", module=model, rank_state=legacy)
    numpy.random.seed(99)
    restore_rng_states(read_rank_state(tmp_path / "old", 0)["rng"])
    assert numpy.random.rand() == expected
