"""consolidate(), the ``megastrategy consolidate`` CLI and load_full_state_dict on real checkpoints."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import checkpoint_runs as runs
from tests.helpers.dist import run_distributed
from tests.helpers.launch import REPO, run_script

pytestmark = pytest.mark.slow
SCRIPT = runs.SCRIPT
TP = 1  # of the round trip: pp=2 here; the tp slicing of load_full_state_dict is in test_sharded.py


def _assert_same_state(got: dict, expected: dict, what: str) -> None:
    assert list(got) == list(expected), f"{what}: keys/order differ: {set(got) ^ set(expected) or 'order'}"
    for k, v in expected.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, (what, k, got[k].shape, v.shape)
        assert torch.equal(got[k], v), (what, k)


def test_consolidated_tp2_pp2_checkpoint_equals_the_same_state_saved_by_tp1_dp2(tmp_path):
    from megastrategy.checkpoint import consolidate, load_full_model_state, read_info, read_lightning_metadata, read_metadata
    from tests.helpers.models import GPT

    _, folder = runs.gpt_tp2_pp2()
    a = folder / runs.EPOCH0
    b = tmp_path / "tp1-dp2.ckpt"
    # restore on tp=1, pp=1 with 2 processes (dp=2): the epoch is done, nothing trains; save again
    run_script(SCRIPT, 2, runs.GPT + ["--tp", "1", "--epochs", "1", "--resume", str(a), "--save", str(b)])
    assert read_info(a)["layout"]["tp"] == 2 and read_info(b)["layout"]["dp"] == 2
    # the two data-parallel replicas of b offered every tensor; DCP kept one copy of each
    md_a, md_b = read_metadata(a).state_dict_metadata, read_metadata(b).state_dict_metadata
    assert all(len(m.chunks) == 1 for k, m in md_b.items() if k.startswith("model/"))
    assert len(md_a["model/wte.weight"].chunks) == 2 and len(md_a["model/ln_f.weight"].chunks) == 1

    full_a, full_b = consolidate(a), consolidate(b)
    original = GPT(n_layer=4).state_dict()  # the user's names, shapes and order
    assert list(full_a) == list(original)
    assert all(full_a[k].shape == v.shape for k, v in original.items())
    assert full_a["wte.weight"].shape == (101, 32)  # vocab padding (51 rows per tp rank) stripped
    assert torch.equal(full_a["wte.weight"], full_a["lm_head.weight"])  # the tie, from the two pp stages
    _assert_same_state(full_b, full_a, "model")

    # optimizer: Adam moments and steps of every parameter, under every name of a tied one
    opt_a = load_full_model_state(a, prefix="optim/0/state/")
    opt_b = load_full_model_state(b, prefix="optim/0/state/")
    assert dict(sorted(opt_a.items())).keys() == dict(sorted(opt_b.items())).keys()
    assert "lm_head.weight/exp_avg" in opt_a and float(opt_a["wte.weight/step"]) == 4.0
    for k in opt_a:
        assert torch.equal(opt_a[k], opt_b[k]), k
    meta = read_lightning_metadata(b)
    assert meta["global_step"] == 4 and meta["user_extra"] == "kept"


def test_cli_consolidates_and_exports_hugging_face(tmp_path, capsys):
    from transformers import BertForSequenceClassification

    from megastrategy.checkpoint import consolidate
    from megastrategy.cli import main
    from tests.helpers.models import BertClassifier

    _, folder = runs.bert_tp2()
    ckpt = folder / runs.EPOCH0
    config_dir, hf_dir, out = tmp_path / "config", tmp_path / "hf", tmp_path / "full.pt"
    BertClassifier(n_layer=2).model.config.save_pretrained(config_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable, "-m", "megastrategy.cli", "consolidate", str(ckpt), str(out),
        "--hf-class", "transformers.BertForSequenceClassification", "--hf-config", str(config_dir),
        "--prefix", "model.", "--hf-out", str(hf_dir),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    full = consolidate(ckpt)
    _assert_same_state(torch.load(out), full, "OUT.pt")
    assert full["model.bert.embeddings.word_embeddings.weight"].shape == (101, 32)  # unpadded
    hf = BertForSequenceClassification.from_pretrained(hf_dir)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, full[f"model.{k}"]), k

    # a single-file Lightning checkpoint that load_from_checkpoint takes
    assert main(["consolidate", str(ckpt), str(tmp_path / "full.ckpt"), "--lightning"]) == 0
    restored = BertClassifier.load_from_checkpoint(tmp_path / "full.ckpt", n_layer=2)
    _assert_same_state(restored.state_dict(), full, "load_from_checkpoint")
    assert main(["info", str(ckpt)]) == 0
    assert "'tp': 2" in capsys.readouterr().out


def _round_trip_worker(rank, world, root):
    from megastrategy.checkpoint import load_full_state_dict, save_sharded
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
    from megastrategy.layers.random import ModelParallelRNGTracker
    from megastrategy.parallel_state import ParallelLayout, ParallelState
    from megastrategy.pipeline.layer_assignment import assign_layers
    from megastrategy.pipeline.stage import cut_stage, find_layer_stack
    from tests.helpers.models import GPT

    ps = ParallelState(ParallelLayout(world_size=world, tp=TP, pp=2), rank)
    torch.manual_seed(123)  # weights unlike the checkpoint's
    module = GPT(n_layer=4)
    plan = resolve_tp_plan(module, GPT.TP_PLAN, TP)
    if TP > 1:
        apply_tp_plan(module, plan, group=ps.tp_group, rng_tracker=ModelParallelRNGTracker(tp_rank=ps.tp_rank, device=torch.device("cpu")))
    path, stack = find_layer_stack(module)
    cut_stage(module, stack_path=path, stack=stack, assignment=assign_layers(len(stack), 2, 1), pp_rank=ps.pp_rank, pp_size=2, vp_size=1)
    full = torch.load(f"{root}/full.pt")
    result = load_full_state_dict(module, full, ps, plan=plan)
    assert not result.missing_keys and result.unexpected_keys  # the other stage's keys
    with pytest.raises(ValueError, match="has shape"):
        bad = {k: v[:100] if k in ("wte.weight", "lm_head.weight") else v for k, v in full.items()}
        load_full_state_dict(module, bad, ps, plan=plan)  # the tied weight is on both stages
    save_sharded(f"{root}/round-trip.ckpt", module=module, parallel_state=ps, plan=plan, stack_path=path)
    ps.destroy()


def test_load_full_state_dict_round_trip_through_pipeline_stages(tmp_path):
    """full -> cut into pp=2 stages (tp slicing: tests/checkpoint/test_sharded.py) -> DCP -> full."""
    from megastrategy.checkpoint import consolidate

    full = consolidate(runs.gpt_tp2_pp2()[1] / runs.EPOCH0)
    torch.save(full, tmp_path / "full.pt")
    run_distributed(_round_trip_worker, TP * 2, str(tmp_path), timeout=300)
    _assert_same_state(consolidate(tmp_path / "round-trip.ckpt"), full, "full -> pipeline stages -> full")
