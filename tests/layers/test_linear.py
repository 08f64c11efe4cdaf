"""Column/row-parallel linear layers vs a serial nn.Linear, at tp=2 (two subgroups of a
4-process world) and tp=4, in ONE spawn."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.linear import ColumnParallelLinear, RowParallelLinear
from megastrategy.layers.mappings import SharedInputCopy, record_collectives
from megastrategy.layers.shard_spec import ShardSpec, get_shard_spec, shard_full_tensor
from tests.helpers.dist import run_distributed

IN, OUT = 8, 12


def _tp_groups():
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [(2, pairs[dist.get_rank() // 2]), (4, dist.group.WORLD)]


def _close(a, b, what, atol=1e-5, rtol=1e-5):
    # torch.testing.assert_close imports DTensor+sympy once dist is initialized (~3 s/process)
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
        err = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what}: max abs difference {err:.3g} (atol={atol}, rtol={rtol})")


def _serial(seed, in_f=IN, out_f=OUT, bias=True, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias, dtype=dtype)


def _inputs(seed, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype)


def _last_dim(t, r, tp, chunks=1):
    n = t.size(-1)
    return shard_full_tensor(t, ShardSpec(dim=t.dim() - 1, full_size=n, padded_size=n, packed_chunks=chunks), r, tp)


def _check_column(tp, group):
    r = dist.get_rank(group)
    lin = _serial(1)
    x0 = _inputs(2, (2, 3, IN))
    G = _inputs(3, (2, 3, OUT))  # upstream gradient of the full output
    xs = x0.clone().requires_grad_(True)
    ys = lin(xs)
    (ys * G).sum().backward()

    for gather in (False, True):
        col = ColumnParallelLinear.from_linear(lin, group=group, gather_output=gather)
        assert col.weight.shape == (OUT // tp, IN) and col.in_features == IN and col.out_features == OUT
        spec = get_shard_spec(col.weight)
        assert spec == ShardSpec(0, OUT, OUT) and get_shard_spec(col.bias) == ShardSpec(0, OUT, OUT)
        _close(col.weight, shard_full_tensor(lin.weight, spec, r, tp), "column weight is the user's slice")
        x = x0.clone().requires_grad_(True)
        y = col(x)
        if gather:
            _close(y, ys, "column gathered output")
            (y * G).sum().backward()
        else:
            _close(y, _last_dim(ys, r, tp), "column local output")
            (y * _last_dim(G, r, tp)).sum().backward()
        _close(x.grad, xs.grad, f"column input grad gather={gather}")
        _close(col.weight.grad, shard_full_tensor(lin.weight.grad, spec, r, tp), "column weight grad")
        _close(col.bias.grad, shard_full_tensor(lin.bias.grad, spec, r, tp), "column bias grad")
        assert "local" in repr(col) and f"out_features={OUT}" in repr(col)

    # skip_bias_add: (out without bias, bias) - local and gathered
    col = ColumnParallelLinear.from_linear(lin, group=group, skip_bias_add=True)
    out, b = col(x0)
    _close(out, _last_dim(ys - lin.bias, r, tp), "skip_bias_add output")
    assert b is col.bias
    col = ColumnParallelLinear.from_linear(lin, group=group, skip_bias_add=True, gather_output=True)
    out, b = col(x0)
    _close(out + b, ys, "skip_bias_add gathered output + bias")
    # no bias
    lin_nb = _serial(4, bias=False)
    col = ColumnParallelLinear.from_linear(lin_nb, group=group, skip_bias_add=True, gather_output=True)
    out, b = col(x0)
    assert b is None and col.bias is None
    _close(out, lin_nb(x0), "no-bias column")


def _check_packed(tp, group):
    r = dist.get_rank(group)
    h = 8  # q, k, v of 8 each: 8/tp rows of each per rank
    lin = _serial(5, in_f=h, out_f=3 * h)
    x0 = _inputs(6, (2, 3, h))
    G = _inputs(7, (2, 3, 3 * h))
    xs = x0.clone().requires_grad_(True)
    ys = lin(xs)
    (ys * G).sum().backward()
    k = h // tp
    q, kk, v = lin.weight.detach().split(h)
    for gather in (False, True):
        col = ColumnParallelLinear.from_linear(lin, group=group, packed_chunks=3, gather_output=gather)
        expect_w = torch.cat([q[r * k:(r + 1) * k], kk[r * k:(r + 1) * k], v[r * k:(r + 1) * k]])
        _close(col.weight, expect_w, "packed weight is [q_r|k_r|v_r]")
        assert get_shard_spec(col.weight).packed_chunks == 3
        x = x0.clone().requires_grad_(True)
        y = col(x)
        if gather:
            _close(y, ys, "packed gathered output")
            (y * G).sum().backward()
        else:
            _close(y, _last_dim(ys, r, tp, chunks=3), "packed local output")
            (y * _last_dim(G, r, tp, chunks=3)).sum().backward()
        _close(x.grad, xs.grad, "packed input grad")
        spec = get_shard_spec(col.weight)
        _close(col.weight.grad, shard_full_tensor(lin.weight.grad, spec, r, tp), "packed weight grad")
        _close(col.bias.grad, shard_full_tensor(lin.bias.grad, get_shard_spec(col.bias), r, tp), "packed bias grad")
    # skip_bias_add + gather with packed: the bias comes back in the user's order
    col = ColumnParallelLinear.from_linear(lin, group=group, packed_chunks=3, gather_output=True, skip_bias_add=True)
    out, b = col(x0)
    _close(b, lin.bias, "packed gathered bias")
    # GPT-2 Conv1D style: from_weight(weight.t())
    col = ColumnParallelLinear.from_weight(lin.weight.t().contiguous().t(), lin.bias, group=group,
                                           packed_chunks=3, gather_output=True)
    _close(col(x0), ys, "from_weight packed")


def _check_packed_sections(tp, group):
    """Grouped-query [q|k|v]: sections of 16, 8 and 8 rows, each split over tp on its own."""
    r = dist.get_rank(group)
    sections = (16, 8, 8)
    lin = _serial(11, in_f=8, out_f=sum(sections))
    x0 = _inputs(12, (2, 3, 8))
    xs = x0.clone().requires_grad_(True)
    ys = lin(xs)
    ys.sum().backward()
    expect_w = torch.cat([s[r * (len(s) // tp):(r + 1) * (len(s) // tp)] for s in lin.weight.detach().split(sections)])
    col = ColumnParallelLinear.from_linear(lin, group=group, packed_sections=sections, gather_output=True)
    _close(col.weight, expect_w, "sectioned weight is [q_r|k_r|v_r]")
    assert get_shard_spec(col.weight).packed_sections == sections and col.packed_chunks == 3
    x = x0.clone().requires_grad_(True)
    y = col(x)
    _close(y, ys, "sectioned gathered output")
    y.sum().backward()
    _close(x.grad, xs.grad, "sectioned input grad")
    _close(col.weight.grad, shard_full_tensor(lin.weight.grad, get_shard_spec(col.weight), r, tp), "sectioned grad")
    with pytest.raises(MegatronConfigError, match=r"packed_sections\[1\]"):
        ColumnParallelLinear(IN, 6 * tp + 2, group=group, packed_sections=(4 * tp, tp + 1, tp + 1))


def _check_row(tp, group):
    r = dist.get_rank(group)
    lin = _serial(8)
    x0 = _inputs(9, (2, 3, IN))
    G = _inputs(10, (2, 3, OUT))
    xs = x0.clone().requires_grad_(True)
    ys = lin(xs)
    (ys * G).sum().backward()
    spec_in = ShardSpec(dim=1, full_size=IN, padded_size=IN)

    row = RowParallelLinear.from_linear(lin, group=group, input_is_parallel=True)
    assert row.weight.shape == (OUT, IN // tp) and get_shard_spec(row.weight) == spec_in
    assert get_shard_spec(row.bias) is None  # replicated
    x_local = _last_dim(x0, r, tp).clone().requires_grad_(True)
    y = row(x_local)
    _close(y, ys, "row output (parallel input)")
    (y * G).sum().backward()
    _close(x_local.grad, _last_dim(xs.grad, r, tp), "row input grad (parallel input)")
    _close(row.weight.grad, shard_full_tensor(lin.weight.grad, spec_in, r, tp), "row weight grad")
    _close(row.bias.grad, lin.bias.grad, "row bias grad")

    row = RowParallelLinear.from_linear(lin, group=group, input_is_parallel=False)
    x = x0.clone().requires_grad_(True)
    y = row(x)
    _close(y, ys, "row output (replicated input)")
    (y * G).sum().backward()
    _close(x.grad, xs.grad, "row input grad (replicated input)")
    _close(row.weight.grad, shard_full_tensor(lin.weight.grad, spec_in, r, tp), "row weight grad 2")
    assert "local" in repr(row)

    row = RowParallelLinear.from_linear(lin, group=group, input_is_parallel=False, skip_bias_add=True)
    out, b = row(x0)
    assert b is row.bias
    _close(out + b, ys, "row skip_bias_add")


def _check_mlp_and_shared_copy(tp, group):
    """Megatron MLP (column -> gelu -> row) and q/k/v sharing one input copy."""
    r = dist.get_rank(group)
    fc1, fc2 = _serial(11, IN, 16), _serial(12, 16, IN)
    x0 = _inputs(13, (4, IN))
    xs = x0.clone().requires_grad_(True)
    ref = fc2(F.gelu(fc1(xs)))
    ref.pow(2).sum().backward()
    c1 = ColumnParallelLinear.from_linear(fc1, group=group)
    r2 = RowParallelLinear.from_linear(fc2, group=group)
    x = x0.clone().requires_grad_(True)
    with record_collectives() as log:
        out = r2(F.gelu(c1(x)))
        out.pow(2).sum().backward()
    _close(out, ref, "mlp output")
    _close(x.grad, xs.grad, "mlp input grad")
    _close(c1.weight.grad, shard_full_tensor(fc1.weight.grad, get_shard_spec(c1.weight), r, tp), "mlp fc1 grad")
    _close(r2.weight.grad, shard_full_tensor(fc2.weight.grad, get_shard_spec(r2.weight), r, tp), "mlp fc2 grad")
    assert [e.op for e in log] == ["all_reduce", "all_reduce"]  # one forward, one backward

    # q, k, v column layers fed the same tensor: ONE backward all-reduce for the input
    lins = [_serial(20 + j) for j in range(3)]
    xs = x0.clone().requires_grad_(True)
    sum((l(xs) ** 2).sum() for l in lins).backward()
    shared = SharedInputCopy(group)
    cols = [ColumnParallelLinear.from_linear(l, group=group, input_copy=shared, gather_output=True) for l in lins]
    x = x0.clone().requires_grad_(True)
    with record_collectives() as log:
        outs = [c(x) for c in cols]
        n_fwd = len(log)
        sum((o ** 2).sum() for o in outs).backward()
    bwd = log[n_fwd:]
    input_reduces = [e for e in bwd if e.op == "all_reduce"]
    assert len(input_reduces) == 1 and input_reduces[0].numel == x.numel(), log
    for o, l in zip(outs, lins):
        _close(o, l(x0), "shared-copy output")
    _close(x.grad, xs.grad, "shared-copy input grad")
    for c, l in zip(cols, lins):
        _close(c.weight.grad, shard_full_tensor(l.weight.grad, get_shard_spec(c.weight), r, tp), "shared-copy weight grad")


def _check_init_dtype_misc(tp, group):
    r = dist.get_rank(group)
    # the plain constructor initializes exactly what nn.Linear would, whatever tp is
    for cls, dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1)):
        torch.manual_seed(30)
        layer = cls(IN, OUT, group=group)
        lin = _serial(30)
        spec = ShardSpec(dim, lin.weight.size(dim), lin.weight.size(dim))
        assert torch.equal(layer.weight, shard_full_tensor(lin.weight, spec, r, tp)), cls.__name__
        expect_b = lin.bias if cls is RowParallelLinear else shard_full_tensor(lin.bias, ShardSpec(0, OUT, OUT), r, tp)
        assert torch.equal(layer.bias, expect_b)
    layer = ColumnParallelLinear(IN, OUT, group=group, bias=False, dtype=torch.float64)
    assert layer.bias is None and layer.weight.dtype == torch.float64

    # dtype and requires_grad of the source are kept
    lin = _serial(31, dtype=torch.float64)
    lin.bias.requires_grad_(False)
    col = ColumnParallelLinear.from_linear(lin, group=group, gather_output=True)
    row = RowParallelLinear.from_linear(lin, group=group, input_is_parallel=False)
    for layer in (col, row):
        assert layer.weight.dtype == torch.float64 and layer.weight.device == lin.weight.device
        assert layer.weight.requires_grad and not layer.bias.requires_grad
        x = _inputs(32, (3, IN), dtype=torch.float64)
        _close(layer(x), lin(x), f"float64 {type(layer).__name__}", atol=1e-12, rtol=1e-12)
    # copies, never aliases, the user's tensor
    assert col.weight.data_ptr() != lin.weight.data_ptr()

    # deepcopy keeps the same process group
    c2 = copy.deepcopy(col)
    assert c2.group is group and torch.equal(c2.weight, col.weight)

    # impossible splits name the argument
    bad = 4 * tp + 2 if tp == 4 else 7
    with pytest.raises(MegatronConfigError, match="out_features"):
        ColumnParallelLinear(IN, bad, group=group)
    with pytest.raises(MegatronConfigError, match="in_features"):
        RowParallelLinear(bad, OUT, group=group)
    with pytest.raises(MegatronConfigError, match="packed_chunks"):
        ColumnParallelLinear(IN, 3 * (tp + 1), group=group, packed_chunks=3)


def _all_checks(rank, world):
    for tp, group in _tp_groups():
        _check_column(tp, group)
        _check_packed(tp, group)
        _check_packed_sections(tp, group)
        _check_row(tp, group)
        _check_mlp_and_shared_copy(tp, group)
        _check_init_dtype_misc(tp, group)
    return True


def test_linear_layers_tp2_and_tp4():
    assert run_distributed(_all_checks, 4) == [True] * 4


def test_world_size_one_matches_serial_without_dist():
    lin = _serial(40)
    x = _inputs(41, (5, IN))
    col = ColumnParallelLinear.from_linear(lin, group=None)
    row = RowParallelLinear.from_linear(lin, group=None, input_is_parallel=False)
    torch.testing.assert_close(col(x), lin(x))
    torch.testing.assert_close(row(x), lin(x))
