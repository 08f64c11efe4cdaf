"""Preset names in Lightning's StrategyRegistry: what each builds, the error for an unknown one,
registration whichever of Lightning and megastrategy is imported first, and a preset trained
against DDP (real processes)."""
import subprocess
import sys

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import megastrategy  # noqa: F401 - registers the presets
from megastrategy import MegatronConfigError, MegatronStrategy
from megastrategy.registry import PRESETS, preset
from tests.helpers.launch import REPO, run_script
from tests.test_strategy_tp import SCRIPT, _assert_same_training


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_its_layout_from_the_registry(name):
    strategy = StrategyRegistry.get(name)
    assert isinstance(strategy, MegatronStrategy)
    for key, value in PRESETS[name].kwargs.items():
        assert getattr(strategy.config, key) == value
    assert StrategyRegistry[name]["description"].startswith("MegatronStrategy: ")


def test_an_unknown_preset_names_every_preset():
    with pytest.raises(MegatronConfigError) as err:
        preset("megatron_tp3")
    assert "'megatron_tp3'" in str(err.value) and all(name in str(err.value) for name in PRESETS)


def test_a_preset_takes_overrides():
    assert preset("megatron_tp2", bucket_numel=1000).config.bucket_numel == 1000


def test_registered_when_lightning_is_imported_after_megastrategy_which_stays_light():
    code = (
        "import sys, megastrategy\n"
        "assert not any(m.startswith('lightning') for m in sys.modules), 'import megastrategy imported Lightning'\n"
        "import lightning as L\n"
        "t = L.Trainer(strategy='megatron_tp2_sp', accelerator='cpu', devices=2, logger=False)\n"
        "assert (t.strategy.config.tp, t.strategy.config.sequence_parallel) == (2, True)\n"
    )
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'src'}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_trainer_strategy_megatron_tp2_trains_like_ddp():
    ours = run_script(SCRIPT, 2, ["--model", "encoder", "--strategy", "megatron", "--strategy-name", "megatron_tp2"])
    assert ours["layout"]["tp"] == 2
    _assert_same_training(ours, run_script(SCRIPT, 1, ["--model", "encoder", "--strategy", "ddp"]))
