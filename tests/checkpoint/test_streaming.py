"""Streaming export: whole tensors one at a time into bounded safetensors shards, from a checkpoint
directory (``megastrategy export``) or straight from a running job (``strategy.export_hf``)."""
from __future__ import annotations

import json

import pytest
import torch

from megastrategy.checkpoint.streaming import _shard_plan
from tests.helpers import checkpoint_runs as runs

EPOCH1 = "epoch=1-step=8.ckpt"  # the run's last checkpoint: its final weights


def test_shards_hold_consecutive_tensors_up_to_the_limit_and_a_large_tensor_alone():
    sizes = [("a", 40), ("b", 50), ("c", 30), ("d", 200), ("e", 10)]
    assert _shard_plan(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert _shard_plan(sizes, 10_000) == [["a", "b", "c", "d", "e"]]


def _assert_export_equals(hf_dir, full: dict, *, max_shard_bytes: int) -> None:
    from transformers import BertForSequenceClassification

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1, "the tiny model should span several small shards"
    for f in files:
        size = (hf_dir / f).stat().st_size
        largest = max(full[f"model.{k}"].numel() * 4 for k, v in index["weight_map"].items() if v == f)
        assert size <= max(max_shard_bytes, largest) + 4096, f"{f}: {size} bytes"  # + safetensors header
    hf = BertForSequenceClassification.from_pretrained(hf_dir)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, full[f"model.{k}"]), k


@pytest.mark.slow
def test_export_hf_from_the_running_tp2_job_equals_its_final_checkpoint():
    from megastrategy.checkpoint import consolidate

    _, folder = runs.bert_tp2()
    _assert_export_equals(folder / "hf", consolidate(folder / EPOCH1), max_shard_bytes=16_000)
    assert not (folder / "hf.staging").exists(), "the staging checkpoint was left behind"


@pytest.mark.slow
def test_cli_export_streams_a_checkpoint_into_hugging_face_shards(tmp_path, capsys):
    from megastrategy.checkpoint import consolidate
    from megastrategy.cli import main
    from tests.helpers.models import BertClassifier

    _, folder = runs.bert_tp2()
    config_dir = tmp_path / "config"
    BertClassifier(n_layer=2).model.config.save_pretrained(config_dir)
    out = tmp_path / "hf"
    assert main(["export", str(folder / runs.EPOCH0), str(out), "--strip", "model.", "--hf-config", str(config_dir),
                 "--max-shard-mb", "0.02"]) == 0
    assert "file(s)" in capsys.readouterr().out
    _assert_export_equals(out, consolidate(folder / runs.EPOCH0), max_shard_bytes=int(0.02 * 1024**2))
    with pytest.raises(ValueError, match="starts with 'bert.'"):  # the user forgot that the model is self.model
        main(["export", str(folder / runs.EPOCH0), str(tmp_path / "x"), "--strip", "bert."])

