"""MegatronStrategy's visible signature: every MegatronConfig field and DDPStrategy's keywords,
so that LightningCLI sets any of them from the command line (in-process parse, and a launched
``LightningCLI`` fit against DDP)."""
import dataclasses
import inspect
from datetime import timedelta
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.strategies import DDPStrategy

from megastrategy import MegatronStrategy
from megastrategy.config import MegatronConfig
from tests.helpers.launch import run_script
from tests.test_strategy_tp import SCRIPT as TRAIN, _assert_same_training

CLI_SCRIPT = Path(__file__).parent / "scripts" / "cli_fit.py"

# One command-line value per field, none of them the default; (text, the value it must become).
CLI_VALUES = {
    "tp": ("2", 2), "pp": ("2", 2), "vp": ("2", 2), "cp": ("1", 1), "cp_layout": ("balanced", "balanced"), "cp_output": ("tokens", "tokens"), "ep": ("2", 2), "etp": ("1", 1),
    "num_microbatches": ("4", 4), "pipeline_schedule": ("1f1b", "1f1b"), "tp_plan": ('{"blocks.*.qkv": "column"}', {"blocks.*.qkv": "column"}),
    "pipeline_layers": ("blocks", "blocks"), "pipeline_stage_layers": ("[1, 2, 1, 2]", (1, 2, 1, 2)), "order": ("tp-cp-ep-pp-dp", "tp-cp-ep-pp-dp"),
    "broadcast_batch": ("true", True), "grad_reduce_in_fp32": ("false", False), "bucket_numel": ("1000", 1000),
    "timeout": ("0:05:00", timedelta(minutes=5)), "watchdog": ("false", False), "heartbeat_timeout": ("5.5", 5.5),
    "detect_anomalies": ("true", True), "async_checkpoint": ("true", True), "on_nonfinite": ("skip", "skip"), "use_distributed_optimizer": ("true", True),
    "overlap_grad_reduce": ("true", True), "overlap_param_gather": ("true", True), "sequence_parallel": ("true", True),
    "activation_checkpointing": ("selective", "selective"), "backend": ("torch", "torch"), "fp8": ("false", False),
    "cuda_graph_scope": ('["moe_router"]', ("moe_router",)),
}


def test_the_signature_lists_every_config_field_then_ddps_keywords():
    params = inspect.signature(MegatronStrategy).parameters
    for f in dataclasses.fields(MegatronConfig):
        assert params[f.name].default == (f.default if f.default is not dataclasses.MISSING else f.default_factory())
    ddp = set(inspect.signature(DDPStrategy).parameters) - {"kwargs"}
    assert ddp <= set(params), f"DDPStrategy keywords missing: {ddp - set(params)}"
    assert list(params)[:2] == ["tp", "pp"] and MegatronStrategy(2).config.tp == 2  # tp stays positional


def test_lightning_cli_sets_every_config_field():
    assert set(CLI_VALUES) == {f.name for f in dataclasses.fields(MegatronConfig)}, "add the new field to CLI_VALUES"
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MegatronStrategy, "strategy")
    cfg = parser.parse_args([f"--strategy.{name}={text}" for name, (text, _) in CLI_VALUES.items()])
    config = parser.instantiate_classes(cfg).strategy.config
    for name, (_, value) in CLI_VALUES.items():
        got = getattr(config, name)
        assert (tuple(got) if name == "cuda_graph_scope" else got) == value, name


def test_a_bad_cli_value_names_the_argument():
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MegatronStrategy, "strategy")
    with pytest.raises(Exception, match="tp"):
        parser.parse_args(["--strategy.tp=two"])


@pytest.mark.slow
def test_lightning_cli_fit_with_tp2_trains_like_ddp():
    args = ["--trainer.strategy=megastrategy.MegatronStrategy", "--trainer.strategy.tp=2",
            "--trainer.strategy.bucket_numel=1000", "--trainer.strategy.timeout=0:05:00"]
    ours = run_script(CLI_SCRIPT, 2, args)
    assert ours["strategy"] == "MegatronStrategy"
    assert (ours["config"]["tp"], ours["config"]["bucket_numel"]) == ("2", "1000")
    _assert_same_training(ours, run_script(TRAIN, 1, ["--model", "encoder", "--strategy", "ddp"]))
