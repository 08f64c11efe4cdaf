"""TensorParallelMultiheadAttention against nn.MultiheadAttention, on real gloo processes.

Every check builds the serial torch module, shards a deep copy of it, runs both on the
same inputs on every rank and compares the output (replicated) and every gradient
(sharded parameters against their slice of the serial gradient, via shard_full_tensor).
The checks run in one spawn per TP size to keep the suite fast.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers.dist import run_distributed

D_MODEL, NHEAD, FFN = 16, 4, 32
DTYPE = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


# ----------------------------------------------------------------------------- helpers
def _serial_name(tp_name: str) -> str:
    return tp_name.replace("in_proj.weight", "in_proj_weight").replace("in_proj.bias", "in_proj_bias")


def _shard_parallelize_mha(module, group, tracker=None):
    """Replace every nn.MultiheadAttention inside ``module`` (or module itself)."""
    from megastrategy.layers.attention import TensorParallelMultiheadAttention

    if isinstance(module, nn.MultiheadAttention):
        return TensorParallelMultiheadAttention.from_module(module, group=group, rng_tracker=tracker)
    for name, child in list(module.named_children()):
        if isinstance(child, nn.MultiheadAttention):
            setattr(module, name, TensorParallelMultiheadAttention.from_module(child, group=group, rng_tracker=tracker))
        else:
            _shard_parallelize_mha(child, group, tracker)
    return module


def _parallelize_layer(layer, group, tracker=None):
    """Shard a TransformerEncoderLayer/DecoderLayer (a deep copy) like the tp_plan would."""
    from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear

    tp = copy.deepcopy(layer)
    _shard_parallelize_mha(tp, group, tracker)
    tp.linear1 = ColumnParallelLinear.from_linear(layer.linear1, group=group)
    tp.linear2 = RowParallelLinear.from_linear(layer.linear2, group=group, input_is_parallel=True)
    return tp


def _assert_close(actual, expected, what):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.allclose(actual, expected, **TOL):
        err = (actual - expected).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err}")


def _compare_grads(tp_module, serial_module, rank, world, what):
    from megastrategy.layers.shard_spec import get_shard_spec, shard_full_tensor

    serial = dict(serial_module.named_parameters())
    seen = 0
    for name, p in tp_module.named_parameters():
        ref = serial[_serial_name(name)]
        spec = get_shard_spec(p)
        ref_value, ref_grad = ref.detach(), ref.grad
        if spec is not None:
            ref_value = shard_full_tensor(ref_value, spec, rank, world)
            ref_grad = shard_full_tensor(ref_grad, spec, rank, world)
        _assert_close(p.detach(), ref_value, f"{what}: value of {name}")
        assert p.grad is not None, f"{what}: {name} got no gradient"
        _assert_close(p.grad, ref_grad, f"{what}: grad of {name}")
        seen += 1
    assert seen == len(serial), f"{what}: {seen} TP params vs {len(serial)} serial params"


def _inputs(shape, seed, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=DTYPE)
    return x.requires_grad_(requires_grad)


def _loss(out, seed):
    g = torch.Generator().manual_seed(seed)
    return (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()


def _padding_mask(bsz, length, lengths):
    return torch.arange(length).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)  # True = pad


# ------------------------------------------------------------------------------ checks
def _check_encoder_layers(rank, world, group):
    bsz, seq = 3, 5
    for batch_first in (True, False):
        for norm_first in (False, True):
            for train in (True, False):
                for masks in ("none", "padding", "causal"):
                    what = f"encoder layer bf={batch_first} nf={norm_first} train={train} masks={masks}"
                    torch.manual_seed(0)
                    serial = nn.TransformerEncoderLayer(
                        D_MODEL, NHEAD, FFN, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=DTYPE
                    )
                    serial.train(train)
                    tp = _parallelize_layer(serial, group)
                    shape = (bsz, seq, D_MODEL) if batch_first else (seq, bsz, D_MODEL)
                    kwargs = {}
                    if masks == "padding":
                        kwargs["src_key_padding_mask"] = _padding_mask(bsz, seq, [5, 3, 4])
                    elif masks == "causal":
                        kwargs["src_mask"] = nn.Transformer.generate_square_subsequent_mask(seq, dtype=DTYPE)
                        kwargs["is_causal"] = True
                    x_s, x_t = _inputs(shape, 1), _inputs(shape, 1)
                    out_s, out_t = serial(x_s, **kwargs), tp(x_t, **kwargs)
                    _assert_close(out_t, out_s, what + ": output")
                    _loss(out_s, 2).backward()
                    _loss(out_t, 2).backward()
                    _assert_close(x_t.grad, x_s.grad, what + ": input grad")
                    _compare_grads(tp, serial, rank, world, what)


def _check_encoder_stack_eval(rank, world, group):
    """TransformerEncoder of 2 layers, eval: with grad, and under no_grad where the serial
    encoder takes its nested-tensor fast path (the TP one must not)."""
    bsz, seq = 3, 6
    for batch_first in (True, False):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, FFN, dropout=0.0, batch_first=batch_first, dtype=DTYPE)
        serial = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True, norm=nn.LayerNorm(D_MODEL, dtype=DTYPE))
        serial.eval()
        tp = copy.deepcopy(serial)
        for i in range(2):
            tp.layers[i] = _parallelize_layer(serial.layers[i], group)
        shape = (bsz, seq, D_MODEL) if batch_first else (seq, bsz, D_MODEL)
        what = f"encoder stack bf={batch_first}"
        causal = nn.Transformer.generate_square_subsequent_mask(seq, dtype=DTYPE)

        # with autograd: outputs and grads (causal mask detected by the encoder itself)
        x_s, x_t = _inputs(shape, 3), _inputs(shape, 3)
        out_s, out_t = serial(x_s, mask=causal), tp(x_t, mask=causal)
        _assert_close(out_t, out_s, what + ": output")
        _loss(out_s, 4).backward()
        _loss(out_t, 4).backward()
        _assert_close(x_t.grad, x_s.grad, what + ": input grad")
        _compare_grads(tp, serial, rank, world, what)

        # inference with a left-aligned padding mask: serial goes nested (batch_first only)
        lengths = [6, 2, 4]
        pad = _padding_mask(bsz, seq, lengths)
        x = _inputs(shape, 5, requires_grad=False)
        with torch.no_grad():
            out_s, out_t = serial(x, src_key_padding_mask=pad), tp(x, src_key_padding_mask=pad)
        valid = ~pad if batch_first else (~pad).t()
        tol = dict(rtol=1e-6, atol=1e-6)  # the serial fused kernels reorder the arithmetic
        assert torch.allclose(out_t[valid], out_s[valid], **tol), what + ": no_grad padded output"
        # the TP encoder computed padded positions (it did not convert to a nested tensor)
        assert out_t[~valid].abs().sum() > 0, what + ": TP encoder took the nested-tensor path"


def _check_encoder_layer_fast_path(rank, world, group):
    """Serial TransformerEncoderLayer in eval + no_grad takes torch's fused path; the TP
    layer declines it and still agrees."""
    from megastrategy.layers.attention import TensorParallelMultiheadAttention

    torch.manual_seed(0)
    serial = nn.TransformerEncoderLayer(D_MODEL, NHEAD, FFN, dropout=0.0, batch_first=True, dtype=DTYPE).eval()
    tp = _parallelize_layer(serial, group).eval()
    attn = tp.self_attn
    assert isinstance(attn, TensorParallelMultiheadAttention)
    assert attn.in_proj_bias is None and attn._qkv_same_embed_dim is False and attn.batch_first is True
    assert attn.embed_dim == D_MODEL and attn.num_heads == NHEAD and attn.num_local_heads == NHEAD // world
    assert torch.overrides.has_torch_function((attn.in_proj_weight,))
    assert attn.in_proj_weight.shape == (3 * D_MODEL // world, D_MODEL)
    x = _inputs((2, 5, D_MODEL), 6, requires_grad=False)
    pad = _padding_mask(2, 5, [5, 3])
    with torch.no_grad():
        for kwargs in ({}, {"src_key_padding_mask": pad}):
            out_s, out_t = serial(x, **kwargs), tp(x, **kwargs)
            keep = ~pad if kwargs else torch.ones(2, 5, dtype=torch.bool)
            assert torch.allclose(out_t[keep], out_s[keep], rtol=1e-6, atol=1e-6), f"fast path {kwargs.keys()}"


def _check_decoder_layer(rank, world, group):
    bsz, tgt_len, src_len = 2, 4, 6
    for batch_first in (True, False):
        for norm_first in (False, True):
            for train in (True, False):
                what = f"decoder layer bf={batch_first} nf={norm_first} train={train}"
                torch.manual_seed(0)
                serial = nn.TransformerDecoderLayer(
                    D_MODEL, NHEAD, FFN, dropout=0.0, batch_first=batch_first, norm_first=norm_first, dtype=DTYPE
                )
                serial.train(train)
                tp = _parallelize_layer(serial, group)
                tshape = (bsz, tgt_len, D_MODEL) if batch_first else (tgt_len, bsz, D_MODEL)
                mshape = (bsz, src_len, D_MODEL) if batch_first else (src_len, bsz, D_MODEL)
                kwargs = dict(
                    tgt_mask=nn.Transformer.generate_square_subsequent_mask(tgt_len, dtype=DTYPE),
                    tgt_is_causal=True,
                    memory_key_padding_mask=_padding_mask(bsz, src_len, [6, 3]),
                    tgt_key_padding_mask=_padding_mask(bsz, tgt_len, [4, 3]),
                )
                t_s, t_t = _inputs(tshape, 7), _inputs(tshape, 7)
                m_s, m_t = _inputs(mshape, 8), _inputs(mshape, 8)
                out_s, out_t = serial(t_s, m_s, **kwargs), tp(t_t, m_t, **kwargs)
                _assert_close(out_t, out_s, what + ": output")
                _loss(out_s, 9).backward()
                _loss(out_t, 9).backward()
                _assert_close(t_t.grad, t_s.grad, what + ": tgt grad")
                _assert_close(m_t.grad, m_s.grad, what + ": memory grad")
                _compare_grads(tp, serial, rank, world, what)


def _check_mha_direct(rank, world, group):
    """Direct calls: need_weights (averaged and per head), 3-D masks, bool/float masks,
    distinct key/value, unbatched inputs, is_causal hints, no bias."""
    bsz, tgt_len, src_len = 2, 3, 5
    gen = torch.Generator().manual_seed(11)
    mask3d = torch.randn(bsz * NHEAD, tgt_len, src_len, generator=gen, dtype=DTYPE)
    bool3d = torch.rand(bsz * NHEAD, tgt_len, src_len, generator=gen) > 0.7
    bool3d[..., 0] = False  # no fully masked row
    kpm_bool = _padding_mask(bsz, src_len, [5, 4])
    kpm_float = torch.zeros(bsz, src_len, dtype=DTYPE).masked_fill(kpm_bool, -1e4)
    mask2d_bool = torch.triu(torch.ones(tgt_len, src_len, dtype=torch.bool), diagonal=3)
    cases = [
        dict(need_weights=True),
        dict(need_weights=True, average_attn_weights=False),
        dict(need_weights=True, attn_mask=mask3d, key_padding_mask=kpm_float),
        dict(need_weights=True, average_attn_weights=False, attn_mask=bool3d, key_padding_mask=kpm_bool),
        dict(need_weights=False, attn_mask=bool3d),
        dict(need_weights=False, attn_mask=mask3d, key_padding_mask=kpm_float),
        dict(need_weights=False, attn_mask=mask2d_bool, key_padding_mask=kpm_bool),
        dict(need_weights=True, attn_mask=mask2d_bool),
    ]
    for batch_first in (False, True):
        for bias in (True, False):
            for kv in ("self", "shared_kv", "distinct"):
                for case in cases:
                    if kv == "self" and tgt_len != src_len:
                        lens = (src_len, src_len)
                    else:
                        lens = (tgt_len, src_len)
                    if kv == "self" and "attn_mask" in case and case["attn_mask"].shape[-2] != src_len:
                        continue
                    what = f"mha bf={batch_first} bias={bias} kv={kv} case={sorted(case)}"
                    torch.manual_seed(1)
                    serial = nn.MultiheadAttention(D_MODEL, NHEAD, bias=bias, batch_first=batch_first, dtype=DTYPE)
                    with torch.no_grad():  # non-zero biases so that they matter
                        for p in serial.parameters():
                            if p.dim() == 1:
                                p.normal_()
                    tp = _shard_parallelize_mha(copy.deepcopy(serial), group)

                    def mk(length, seed):
                        shape = (bsz, length, D_MODEL) if batch_first else (length, bsz, D_MODEL)
                        return _inputs(shape, seed)

                    q_s = mk(lens[0], 20)
                    q_t = mk(lens[0], 20)
                    if kv == "self":
                        args_s, args_t = (q_s, q_s, q_s), (q_t, q_t, q_t)
                    elif kv == "shared_kv":
                        k_s, k_t = mk(lens[1], 21), mk(lens[1], 21)
                        args_s, args_t = (q_s, k_s, k_s), (q_t, k_t, k_t)
                    else:
                        k_s, k_t = mk(lens[1], 21), mk(lens[1], 21)
                        v_s, v_t = mk(lens[1], 22), mk(lens[1], 22)
                        args_s, args_t = (q_s, k_s, v_s), (q_t, k_t, v_t)
                    out_s, w_s = serial(*args_s, **case)
                    out_t, w_t = tp(*args_t, **case)
                    _assert_close(out_t, out_s, what + ": output")
                    loss_s, loss_t = _loss(out_s, 23), _loss(out_t, 23)
                    if case.get("need_weights"):
                        assert w_t is not None
                        _assert_close(w_t, w_s, what + ": attention weights")
                        loss_s = loss_s + _loss(w_s, 24)
                        loss_t = loss_t + _loss(w_t, 24)
                    else:
                        assert w_s is None and w_t is None
                    loss_s.backward()
                    loss_t.backward()
                    distinct_s = list({id(a): a for a in args_s}.values())
                    distinct_t = list({id(a): a for a in args_t}.values())
                    for i, (a_t, a_s) in enumerate(zip(distinct_t, distinct_s)):
                        _assert_close(a_t.grad, a_s.grad, f"{what}: input {i} grad")
                    _compare_grads(tp, serial, rank, world, what)

    # unbatched input, with per-head (3-D) mask and padding mask
    torch.manual_seed(2)
    serial = nn.MultiheadAttention(D_MODEL, NHEAD, dtype=DTYPE)
    tp = _shard_parallelize_mha(copy.deepcopy(serial), group)
    m3 = torch.randn(NHEAD, 4, 4, generator=gen, dtype=DTYPE)
    kpm = torch.tensor([False, False, True, False])
    for nw, avg in ((True, True), (True, False), (False, True)):
        x_s, x_t = _inputs((4, D_MODEL), 30), _inputs((4, D_MODEL), 30)
        out_s, w_s = serial(x_s, x_s, x_s, attn_mask=m3, key_padding_mask=kpm, need_weights=nw, average_attn_weights=avg)
        out_t, w_t = tp(x_t, x_t, x_t, attn_mask=m3, key_padding_mask=kpm, need_weights=nw, average_attn_weights=avg)
        _assert_close(out_t, out_s, f"unbatched nw={nw} avg={avg}")
        if nw:
            _assert_close(w_t, w_s, f"unbatched weights avg={avg}")
        _loss(out_s, 31).backward()
        _loss(out_t, 31).backward()
        _assert_close(x_t.grad, x_s.grad, "unbatched input grad")

    # is_causal hint, with and without weights / padding
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=DTYPE)
    for nw in (False, True):
        for kpm in (None, _padding_mask(bsz, 5, [5, 3])):
            x = _inputs((5, bsz, D_MODEL), 32, requires_grad=False)
            out_s, w_s = serial(x, x, x, attn_mask=causal, is_causal=True, need_weights=nw, key_padding_mask=kpm)
            out_t, w_t = tp(x, x, x, attn_mask=causal, is_causal=True, need_weights=nw, key_padding_mask=kpm)
            _assert_close(out_t, out_s, f"is_causal nw={nw} kpm={kpm is not None}")
            if nw:
                _assert_close(w_t, w_s, "is_causal weights")
    x = _inputs((5, bsz, D_MODEL), 32, requires_grad=False)
    with pytest.raises(RuntimeError, match="attn_mask"):
        tp(x, x, x, is_causal=True)
    with pytest.raises(RuntimeError, match="3D attn_mask"):
        tp(x, x, x, attn_mask=torch.zeros(NHEAD, 5, 5, dtype=DTYPE))


def _check_dropout_streams(rank, world, group):
    """Attention dropout runs on the tracker: local heads of different TP ranks get
    different masks (with a shared stream they would repeat each other), and the
    RNG-replaying checkpoint reproduces a dropout-heavy TP layer bitwise."""
    from megastrategy.layers.random import ModelParallelRNGTracker, TensorParallelRegionDropout, checkpoint

    tracker = ModelParallelRNGTracker(tp_rank=rank, device=torch.device("cpu"))
    torch.manual_seed(0)
    serial = nn.MultiheadAttention(D_MODEL, NHEAD, dropout=0.5, batch_first=True, dtype=DTYPE)
    x = _inputs((2, 6, D_MODEL), 40, requires_grad=False)
    per_rank_masks = {}
    for use_tracker in (True, False):
        tracker.seed(1)
        torch.manual_seed(1)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp = _shard_parallelize_mha(copy.deepcopy(serial), group, tracker if use_tracker else None)
        _, w = tp(x, x, x, need_weights=True, average_attn_weights=False)  # [N, H, L, S], gathered
        zeros = (w == 0).reshape(2, world, NHEAD // world, 6, 6).transpose(0, 1)  # by owning rank
        per_rank_masks[use_tracker] = zeros
        # the gathered weights are identical on every rank
        ref = w.clone()
        dist.broadcast(ref, src=0, group=group)
        assert torch.equal(ref, w)
    same_masks_with_tracker = all(torch.equal(per_rank_masks[True][0], per_rank_masks[True][r]) for r in range(world))
    same_masks_without = all(torch.equal(per_rank_masks[False][0], per_rank_masks[False][r]) for r in range(world))
    assert not same_masks_with_tracker, "TP ranks drew the same attention-dropout masks despite the tracker"
    assert same_masks_without, "control: without a tracker the ranks share the default stream"

    # a whole TP encoder layer with dropout everywhere, checkpointed or not: bitwise equal
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, NHEAD, FFN, dropout=0.3, batch_first=True, dtype=DTYPE)
    tp_layer = _parallelize_layer(layer, group, tracker)
    tp_layer.dropout = TensorParallelRegionDropout.from_dropout(tp_layer.dropout, tracker)  # FFN hidden: sharded
    results = []
    for use_ckpt in (False, True):
        for p in tp_layer.parameters():
            p.grad = None
        torch.manual_seed(5)
        tracker.seed(5)
        xs = [_inputs((2, 6, D_MODEL), 41 + i) for i in range(2)]
        outs = [checkpoint(tp_layer, xi, rng_tracker=tracker) if use_ckpt else tp_layer(xi) for xi in xs]
        torch.rand(3)
        with tracker.fork():
            torch.rand(3)
        sum(_loss(o, 42) for o in outs).backward()
        results.append((outs, [xi.grad for xi in xs], [p.grad.clone() for p in tp_layer.parameters()], tracker.get_state()))
    (o0, xg0, g0, s0), (o1, xg1, g1, s1) = results
    for a, b in zip(o0 + xg0 + g0, o1 + xg1 + g1):
        assert torch.equal(a, b), "checkpointed TP layer differs from the plain one"
    assert torch.equal(s0["model_parallel_rng_state"], s1["model_parallel_rng_state"])


def _check_config_errors(rank, world, group):
    from megastrategy.errors import MegatronConfigError
    from megastrategy.layers.attention import TensorParallelMultiheadAttention as TPMHA

    bad_heads = world + 1
    with pytest.raises(MegatronConfigError, match=f"num_heads={bad_heads}.*replicate"):
        TPMHA.from_module(nn.MultiheadAttention(bad_heads * 2, bad_heads), group=group)
    with pytest.raises(MegatronConfigError, match="kdim=8.*replicate"):
        TPMHA.from_module(nn.MultiheadAttention(D_MODEL, NHEAD, kdim=8, vdim=8), group=group)
    with pytest.raises(MegatronConfigError, match="add_bias_kv"):
        TPMHA.from_module(nn.MultiheadAttention(D_MODEL, NHEAD, add_bias_kv=True), group=group)
    with pytest.raises(MegatronConfigError, match="add_zero_attn"):
        TPMHA.from_module(nn.MultiheadAttention(D_MODEL, NHEAD, add_zero_attn=True), group=group)
    with pytest.raises(TypeError):
        TPMHA.from_module(nn.Linear(4, 4), group=group)
    # fresh construction (no user module)
    fresh = TPMHA(D_MODEL, NHEAD, group=group, batch_first=True)
    out, w = fresh(*(3 * [torch.randn(2, 3, D_MODEL)]))
    assert out.shape == (2, 3, D_MODEL) and w.shape == (2, 3, 3)


def _check_collectives(rank, world, group):
    """Self-attention costs one all-reduce forward (out_proj) and one backward (input
    gradient); cross-attention with key is value one more backward (memory gradient);
    the weights cost one more forward collective only when asked for. A SharedInputCopy
    given as input_copy is used for the input."""
    from megastrategy.layers.mappings import SharedInputCopy, record_collectives
    from megastrategy.layers.attention import TensorParallelMultiheadAttention as TPMHA

    def ops(log):
        return sorted(r.op for r in log)

    torch.manual_seed(0)
    serial = nn.MultiheadAttention(D_MODEL, NHEAD, batch_first=True, dtype=DTYPE)
    tp = TPMHA.from_module(serial, group=group)
    x, mem = _inputs((2, 3, D_MODEL), 50), _inputs((2, 5, D_MODEL), 51)
    for (q, k, v), nw, avg, fwd, bwd in [
        ((x, x, x), False, True, ["all_reduce"], ["all_reduce"]),
        ((x, x, x), True, True, ["all_reduce", "all_reduce"], ["all_reduce"]),
        ((x, x, x), True, False, ["all_gather", "all_reduce"], ["all_reduce"]),
        ((x, mem, mem), False, True, ["all_reduce"], ["all_reduce", "all_reduce"]),
        ((x, mem, mem.clone()), False, True, ["all_reduce"], ["all_reduce"] * 3),
    ]:
        with record_collectives() as log_f:
            out, w = tp(q, k, v, need_weights=nw, average_attn_weights=avg)
        loss = out.sum() if w is None else out.sum() + w.sum() * 0
        with record_collectives() as log_b:
            loss.backward()
        assert ops(log_f) == fwd, (nw, avg, ops(log_f))
        assert ops(log_b) == bwd, (nw, avg, ops(log_b))

    shared = SharedInputCopy(group)
    tp_shared = TPMHA.from_module(serial, group=group, input_copy=shared)
    assert tp_shared.input_copy is shared and tp_shared.in_proj.input_copy is shared
    x_s, x_t = _inputs((2, 3, D_MODEL), 52), _inputs((2, 3, D_MODEL), 52)
    m_s, m_t = _inputs((2, 5, D_MODEL), 53), _inputs((2, 5, D_MODEL), 53)
    for args_s, args_t in (((x_s, x_s, x_s), (x_t, x_t, x_t)), ((x_s, m_s, m_s), (x_t, m_t, m_t))):
        out_s = serial(*args_s, need_weights=False)[0]
        out_t = tp_shared(*args_t, need_weights=False)[0]
        _assert_close(out_t, out_s, "input_copy output")
        _loss(out_s, 54).backward()
        _loss(out_t, 54).backward()
    _assert_close(x_t.grad, x_s.grad, "input_copy query grad")
    _assert_close(m_t.grad, m_s.grad, "input_copy memory grad")
    # deep copies keep the group (and the tracker) instead of failing on the ProcessGroup
    tp_copy = copy.deepcopy(tp_shared)
    assert tp_copy.group is group and tp_copy.in_proj.group is group
    assert tp_copy.in_proj.weight is not tp_shared.in_proj.weight


CHECKS = [
    _check_config_errors,
    _check_mha_direct,
    _check_encoder_layers,
    _check_encoder_stack_eval,
    _check_encoder_layer_fast_path,
    _check_decoder_layer,
    _check_dropout_streams,
    _check_collectives,
]


def _run_checks(rank, world, names):
    torch.manual_seed(0)
    group = dist.new_group(list(range(world)))
    done = []
    for check in CHECKS:
        if check.__name__ in names:
            check(rank, world, group)
            done.append(check.__name__)
    return done


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_attention_matches_serial(world):
    names = [c.__name__ for c in CHECKS]
    results = run_distributed(_run_checks, world, names, timeout=240)
    assert all(r == names for r in results)
