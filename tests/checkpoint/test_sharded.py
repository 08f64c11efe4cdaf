"""The checkpoint building blocks on real gloo processes, without a Trainer.

Models cover every way a rank's tensor differs from the user's: vocabulary padding and a tied
head (hand-written GPT, user plan), packed QKV with renamed parameters (nn.TransformerEncoder,
auto plan), packed QKV stored transposed (Hugging Face GPT-2 ``Conv1D``, auto plan), and (when LitGPT is
installed) a grouped-query ``[q|k|v]`` of unequal packed sections (LitGPT, built-in plan).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed

TP = 2


def _models():
    """name -> (module, tp_plan): identical on every rank (fixed seeds)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.helpers.models import GPT, EncoderClassifier

    torch.manual_seed(0)
    gpt = GPT(n_layer=2)
    torch.manual_seed(1)
    enc = EncoderClassifier(n_layer=1)
    torch.manual_seed(2)
    cfg = GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    gpt2 = nn.ModuleDict({"model": GPT2LMHeadModel(cfg)})
    models = {"gpt": (gpt, GPT.TP_PLAN), "encoder": (enc, None), "gpt2": (gpt2, None)}
    if importlib.util.find_spec("litgpt") is not None:  # optional: installed with --no-deps
        from tests.helpers.litgpt_runs import tiny_litgpt

        torch.manual_seed(3)
        models["litgpt_gqa"] = (tiny_litgpt(groups=2), None)
    return models


def _shard_worker(rank, world, root):
    from megastrategy.checkpoint import (
        load_full_state_dict,
        load_model_,
        load_optimizer_states,
        module_layout,
        save_sharded,
    )
    from megastrategy.layers.plan import apply_tp_plan, resolve_tp_plan
    from megastrategy.layers.random import ModelParallelRNGTracker
    from megastrategy.parallel_state import ParallelLayout, ParallelState

    ps = ParallelState(ParallelLayout(world_size=world, tp=TP), rank)
    report = {}
    for name, (module, tp_plan) in _models().items():
        full = {k: v.clone() for k, v in module.state_dict().items()}
        plan = resolve_tp_plan(module, tp_plan, TP)
        tracker = ModelParallelRNGTracker(tp_rank=ps.tp_rank, device=torch.device("cpu"))
        apply_tp_plan(module, plan, group=ps.tp_group, rng_tracker=tracker)
        layout = module_layout(module, ps.tp_rank, ps.tp_size, plan)
        by_name = {lay.name: (t, lay) for t, lay in layout.tensors.values()}
        assert set(by_name) == set(full), (name, set(by_name) ^ set(full))

        # single shards go to DCP as DTensors; packed [q_r|k_r|v_r] as several chunks
        from torch.distributed.tensor import DTensor

        from megastrategy.checkpoint.dcp_io import ChunkedTensor, MeshCache, to_dcp_object

        meshes = MeshCache({"tp": ps.tp_group})
        kinds = {n: type(to_dcp_object(lay, t, meshes)) for n, (t, lay) in by_name.items()}
        expect = {
            "gpt": {"wte.weight": DTensor, "blocks.0.proj.weight": DTensor, "ln_f.weight": torch.Tensor},
            "encoder": {"encoder.layers.0.self_attn.in_proj_weight": ChunkedTensor, "encoder.layers.0.linear1.bias": DTensor},
            "gpt2": {"model.transformer.h.0.attn.c_attn.weight": ChunkedTensor, "model.transformer.h.0.mlp.c_fc.weight": DTensor},
            "litgpt_gqa": {"transformer.h.0.attn.qkv.weight": ChunkedTensor, "transformer.h.0.mlp.fc_1.weight": DTensor},
        }[name]
        for n, kind in expect.items():
            assert kinds[n] is kind, (name, n, kinds[n])

        # optimizer state: moments are functions of the full weights, cut like the parameters
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        for p in module.parameters():
            lay = layout.canonical()[layout.param_names[id(p)][0]][1]
            w = full[lay.name]
            opt.state[p] = {
                "step": torch.tensor(3.0),
                "exp_avg": lay.shard_full(2 * w).clone(),
                "exp_avg_sq": lay.shard_full(w * w + 1).clone(),
            }
        path = f"{root}/{name}"
        save_sharded(path, module=module, parallel_state=ps, optimizers=[opt], plan=plan)

        # same layout, in place: zero everything, load, compare with a fresh cut of the full weights
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        load_model_(path, module, ps, plan=plan)
        for t, lay in layout.tensors.values():
            assert torch.equal(t, lay.shard_full(full[lay.name])), (name, lay.name)
        states = load_optimizer_states(path, module, [opt], ps, plan=plan)[0]
        flat = [p for g in opt.param_groups for p in g["params"]]
        for idx, p in enumerate(flat):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(states["state"][idx][key], opt.state[p][key]), (name, idx, key)
        assert states["param_groups"][0]["lr"] == 1e-3
        opt.load_state_dict(states)

        # load_full_state_dict: the full weights cut for this rank, padding rows zero
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(7.0)
        load_full_state_dict(module, full, ps, plan=plan)
        for t, lay in layout.tensors.values():
            assert torch.equal(t, lay.shard_full(full[lay.name])), (name, lay.name)

        # another layout (tp=1, the user's own module): model and optimizer
        fresh, _ = _models()[name]
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        load_model_(path, fresh)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, full[k]), (name, k)
        opt1 = torch.optim.AdamW(fresh.parameters(), lr=5.0)
        states1 = load_optimizer_states(path, fresh, [opt1])[0]
        names1 = {id(p): n for n, p in fresh.named_parameters()}
        for idx, p in enumerate(q for g in opt1.param_groups for q in g["params"]):
            w = full[names1[id(p)]]
            assert torch.equal(states1["state"][idx]["exp_avg"], 2 * w), (name, names1[id(p)])
            assert torch.equal(states1["state"][idx]["exp_avg_sq"], w * w + 1)
        opt1.load_state_dict(states1)
        assert opt1.param_groups[0]["lr"] == 1e-3
        report[name] = sorted(full)
        if rank == 0:
            torch.save(full, f"{root}/{name}.full.pt")
    ps.destroy()
    return report


@pytest.mark.slow
def test_save_consolidate_and_reload_on_other_layouts(tmp_path):
    from megastrategy.checkpoint import consolidate

    run_distributed(_shard_worker, TP, str(tmp_path), timeout=240)
    for name in [n for n in ("gpt", "encoder", "gpt2", "litgpt_gqa") if (tmp_path / f"{n}.full.pt").exists()]:
        full = torch.load(tmp_path / f"{name}.full.pt")
        got = consolidate(tmp_path / name)
        assert list(got) == list(full), name  # names AND the state_dict order
        for k, v in full.items():
            assert got[k].shape == v.shape and torch.equal(got[k], v), (name, k)
    # the renamed / transposed / padded cases really occurred
    enc = consolidate(tmp_path / "encoder")
    assert enc["encoder.layers.0.self_attn.in_proj_weight"].shape == (96, 32)
    gpt2 = consolidate(tmp_path / "gpt2")
    assert gpt2["model.transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D [in, out]
    assert consolidate(tmp_path / "gpt")["wte.weight"].shape == (101, 32)
    if (tmp_path / "litgpt_gqa.full.pt").exists():  # 4 query, 2 key, 2 value heads of 8
        assert consolidate(tmp_path / "litgpt_gqa")["transformer.h.0.attn.qkv.weight"].shape == (64, 32)


def _experts_worker(rank, world, root):
    """MoE experts: split over expert-TP (etp=2), or distributed over expert parallelism (ep=2)."""
    from megastrategy.checkpoint import load_model_, save_sharded
    from megastrategy.moe.experts import Experts
    from megastrategy.parallel_state import ParallelLayout, ParallelState

    ps = ParallelState(ParallelLayout(world_size=world, tp=world), rank)
    for name, (ep, etp) in {"etp2": (1, world), "ep2": (world, 1)}.items():
        torch.manual_seed(5)
        module = nn.ModuleDict({"experts": Experts(4, 8, 16)})
        full = {k: v.clone() for k, v in module.state_dict().items()}
        ep_rank = rank if ep > 1 else 0
        module["experts"].shard(ep, ep_rank, etp_group=ps.tp_group if etp > 1 else None, etp_rank=rank if etp > 1 else 0)
        save_sharded(f"{root}/{name}", module=module, parallel_state=ps)
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        load_model_(f"{root}/{name}", module, ps)
        for k, v in module.state_dict().items():
            w = full[k]
            if etp > 1 and k.endswith(("w1", "b1")):
                w = w.chunk(etp, 0)[rank]
            elif etp > 1 and k.endswith("w2"):
                w = w.chunk(etp, 1)[rank]
            assert torch.equal(v, w), (name, k)
        if rank == 0:
            torch.save(full, f"{root}/{name}.full.pt")
    ps.destroy()


@pytest.mark.slow
def test_moe_experts_split_over_expert_tp_or_expert_parallel(tmp_path):
    pytest.importorskip("megastrategy.moe.experts")
    from megastrategy.checkpoint import consolidate

    run_distributed(_experts_worker, 2, str(tmp_path), timeout=240)
    for name in ("etp2", "ep2"):
        full = torch.load(tmp_path / f"{name}.full.pt")
        got = consolidate(tmp_path / name)
        assert list(got) == list(full), name  # ep=2: each rank held other experts; order rebuilt
        for k, v in full.items():
            assert torch.equal(got[k], v), (name, k)


def test_incomplete_checkpoint_is_refused_with_a_clear_message(tmp_path):
    from megastrategy.checkpoint import CheckpointNotFoundError, consolidate
    from megastrategy.checkpoint.dcp_io import check_checkpoint_dir

    (tmp_path / "half.ckpt").mkdir()
    (tmp_path / "half.ckpt" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointNotFoundError, match=r"\.metadata is missing"):
        consolidate(tmp_path / "half.ckpt")
    (tmp_path / "gone.ckpt.tmp").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="interrupted"):
        check_checkpoint_dir(tmp_path / "gone.ckpt")


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage"])
def test_a_damaged_shard_is_refused_before_anything_is_loaded(tmp_path, damage):
    from megastrategy.checkpoint import CheckpointCorruptError
    from megastrategy.checkpoint.sharded import load_model_, save_sharded

    torch.manual_seed(0)
    saved = nn.Linear(4, 4)
    save_sharded(tmp_path / "c.ckpt", module=saved)
    shard = next((tmp_path / "c.ckpt").glob("*.distcp"))
    if damage == "missing":
        shard.unlink()
    elif damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:10])
    else:
        shard.write_bytes(b"\0" * shard.stat().st_size)
    target = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    match = {"missing": r"is missing", "truncated": r"has 10 bytes", "garbage": r"could not be read"}[damage]
    with pytest.raises(CheckpointCorruptError, match=match):
        load_model_(tmp_path / "c.ckpt", target)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing half-loaded


def test_a_kill_between_the_two_renames_of_a_replacing_save_loses_nothing(tmp_path):
    import os

    from megastrategy.checkpoint.sharded import load_full_model_state, save_sharded

    first = nn.Linear(3, 3)
    save_sharded(tmp_path / "last.ckpt", module=first)
    os.replace(tmp_path / "last.ckpt", tmp_path / "last.ckpt.old")  # killed right after the first rename
    with pytest.warns(UserWarning, match="interrupted; the previous checkpoint was restored"):
        restored = load_full_model_state(tmp_path / "last.ckpt")
    assert torch.equal(restored["weight"], first.weight)

    os.replace(tmp_path / "last.ckpt", tmp_path / "last.ckpt.old")  # ... and the next save heals it too
    second = nn.Linear(3, 3)
    save_sharded(tmp_path / "last.ckpt", module=second)
    assert torch.equal(load_full_model_state(tmp_path / "last.ckpt")["weight"], second.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_state_dict_order_is_rebuilt_from_interleaved_pipeline_stages():
    from megastrategy.checkpoint.sharded import merged_key_order

    # pp=2, vp=2 over 4 blocks: stage 0 holds blocks 0 and 2, stage 1 blocks 1 and 3
    stages = {
        1: ["blocks.1.w", "blocks.3.w", "norm.w", "head.w"],
        0: ["emb.w", "pos.w", "blocks.0.w", "blocks.0.b", "blocks.2.w", "blocks.2.b"],
    }
    assert merged_key_order(stages, "blocks") == [
        "emb.w", "pos.w", "blocks.0.w", "blocks.0.b", "blocks.1.w", "blocks.2.w", "blocks.2.b", "blocks.3.w",
        "norm.w", "head.w",
    ]
    assert merged_key_order({0: ["a", "b.0.x", "c"]}, None) == ["a", "b.0.x", "c"]


def test_state_dict_order_is_rebuilt_from_ranks_holding_different_experts():
    from megastrategy.checkpoint.sharded import merge_orders

    rank0 = ["emb", "moe.router", "moe.experts.0.w", "moe.experts.1.w", "norm"]
    rank1 = ["emb", "moe.router", "moe.experts.2.w", "moe.experts.3.w", "norm", "head"]
    assert merge_orders([rank0, rank1]) == [
        "emb", "moe.router", "moe.experts.0.w", "moe.experts.1.w", "moe.experts.2.w", "moe.experts.3.w", "norm", "head",
    ]
