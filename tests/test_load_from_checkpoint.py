"""``MyModule.load_from_checkpoint(best_model_path)`` on a megastrategy checkpoint, in one plain
process, gives what it gives on DDP's checkpoint of the same run: the hyper-parameters saved by
``self.save_hyperparameters()``, the same weights (within 2e-4) in the user's original names and
shapes, the same epoch and user keys; ``trainer.validate(model, ckpt_path=...)`` on one plain device
scores it as it was scored, and resuming ``fit`` from it there says to resume with MegatronStrategy.
Lightning's own checkpoint files still load through Lightning.
"""
import subprocess
import sys

import lightning as L
import pytest
import torch

import megastrategy  # noqa: F401 - installs the loader
from megastrategy.errors import MegatronCheckpointError
from megastrategy.load_from_checkpoint import is_megastrategy_checkpoint, load_as_lightning_checkpoint
from tests.helpers.habit_model import HabitBert
from tests.helpers.habit_runs import FROZEN_EMBEDDINGS, FROZEN_LAYERS, habit_run
from tests.helpers.launch import REPO

TOL = 2e-4


def _same_module(ours: HabitBert, ref: HabitBert) -> None:
    assert dict(ours.hparams) == dict(ref.hparams)
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert mine[name].shape == value.shape and torch.allclose(mine[name], value, atol=TOL), name


@pytest.mark.slow
@pytest.mark.parametrize("layout, habits", [("tp2", FROZEN_EMBEDDINGS), ("pp2", FROZEN_LAYERS)])
def test_the_best_checkpoint_loads_as_ddps_does(layout, habits):
    (ours, _), (ref, _) = habit_run(layout, habits), habit_run("ddp", habits)
    assert is_megastrategy_checkpoint(ours["best"]) and not is_megastrategy_checkpoint(ref["best"])
    _same_module(HabitBert.load_from_checkpoint(ours["best"]), HabitBert.load_from_checkpoint(ref["best"]))
    saved, theirs = load_as_lightning_checkpoint(ours["best"]), torch.load(ref["best"], weights_only=False)
    assert (saved["epoch"], saved["global_step"]) == (theirs["epoch"], theirs["global_step"])
    assert set(theirs) <= set(saved)


@pytest.mark.slow
def test_a_plain_trainer_evaluates_it_and_refuses_to_resume_from_it_clearly():
    ours, _ = habit_run("tp2", FROZEN_EMBEDDINGS)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_steps=20,
                        enable_checkpointing=False)
    validated = trainer.validate(HabitBert(freeze_embeddings=True), ckpt_path=ours["best"], verbose=False)
    assert abs(validated[0]["val_loss"] - ours["best_score"]) <= TOL  # the score it was kept for
    with pytest.raises(MegatronCheckpointError, match="Resume fit from it with strategy=MegatronStrategy"):
        trainer.fit(HabitBert(freeze_embeddings=True), ckpt_path=ours["best"])


@pytest.mark.slow
def test_it_loads_in_a_process_that_imports_megastrategy_before_lightning():
    ours, _ = habit_run("tp2", FROZEN_EMBEDDINGS)
    code = (
        "import sys, megastrategy\n"
        "assert 'lightning' not in sys.modules\n"
        "from tests.helpers.habit_model import HabitBert\n"
        f"m = HabitBert.load_from_checkpoint({ours['best']!r})\n"
        "assert m.hparams.freeze_embeddings\n"
    )
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'src'}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_optimizer_states_are_there_only_if_saved_and_refuse_use(tmp_path, with_optimizer):
    from megastrategy.checkpoint.sharded import save_sharded

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    with pytest.warns(UserWarning, match="single process"):  # DCP without a process group says so
        save_sharded(tmp_path, module=model, optimizers=[opt] if with_optimizer else None,
                     lightning={"epoch": 2, "hyper_parameters": {"lr": 0.1}})
    checkpoint = load_as_lightning_checkpoint(tmp_path, map_location="cpu")
    assert checkpoint["epoch"] == 2 and checkpoint["hyper_parameters"] == {"lr": 0.1}
    assert all(torch.equal(checkpoint["state_dict"][k], v) for k, v in model.state_dict().items())
    assert ("optimizer_states" in checkpoint) == with_optimizer  # save_weights_only=True saves none
    if with_optimizer:
        with pytest.raises(MegatronCheckpointError, match="only MegatronStrategy reads"):
            list(checkpoint["optimizer_states"])


def test_only_a_checkpoint_directory_is_taken(tmp_path):
    (tmp_path / "file.ckpt").write_bytes(b"")
    assert not is_megastrategy_checkpoint(tmp_path / "file.ckpt") and not is_megastrategy_checkpoint(tmp_path)
    assert not is_megastrategy_checkpoint(object()) and not is_megastrategy_checkpoint("https://x/y.ckpt")
    (tmp_path / ".metadata").write_bytes(b"")
    assert is_megastrategy_checkpoint(str(tmp_path))


def test_lightnings_loader_is_wrapped_once_and_still_loads_files(tmp_path):
    from lightning.fabric.plugins.io import torch_io
    from lightning.pytorch.core import saving

    megastrategy.load_from_checkpoint.install()  # a second install wraps nothing more
    torch.save({"a": torch.ones(2)}, tmp_path / "plain.ckpt")
    for reader in (saving, torch_io):
        assert not hasattr(reader.pl_load.megastrategy_wraps, "megastrategy_wraps")
        assert torch.equal(reader.pl_load(tmp_path / "plain.ckpt")["a"], torch.ones(2))
