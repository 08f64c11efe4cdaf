"""Conjugate collectives on real gloo processes: tp=2 (two subgroups of a 4-process world,
so group-local ranks differ from global ranks) and tp=4 (the world), in ONE spawn."""
import pytest
import torch
import torch.distributed as dist

from megastrategy.layers import mappings as M
from tests.helpers.dist import run_distributed


def _tp_groups():
    # every rank must create every subgroup, in the same order
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = dist.get_rank()
    return [(2, pairs[rank // 2]), (4, dist.group.WORLD)]


def _val(seed, r, shape):
    g = torch.Generator().manual_seed(1000 * seed + r)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _fwd_bwd(fn, x, w):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (y * w).sum().backward()
    return y.detach(), x.grad


def _check(a, b, what, atol=1e-6, rtol=1e-6):
    # torch.testing.assert_close imports DTensor+sympy once dist is initialized (~3 s/process)
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
        err = (a.double() - b.double()).abs().max().item()
        raise AssertionError(f"{what}: max abs difference {err:.3g} (atol={atol}, rtol={rtol})")


def _check_collectives(rank, world):
    for tp, group in _tp_groups():
        r = dist.get_rank(group)
        assert M.group_world_size(group) == tp and M.group_rank(group) == r
        shape = (4, 3, 8)
        xs = [_val(1, i, shape) for i in range(tp)]  # every rank's input, known everywhere
        x = xs[r]

        # copy: fwd identity, bwd all-reduce
        ws = [_val(2, i, shape) for i in range(tp)]
        with M.record_collectives() as log:
            y, gx = _fwd_bwd(lambda t: M.copy_to_tensor_parallel_region(t, group), x, ws[r])
        _check(y, x, f"copy fwd tp={tp}")
        _check(gx, sum(ws), f"copy bwd tp={tp}")
        assert [(e.op, e.numel, e.bytes) for e in log] == [("all_reduce", x.numel(), x.numel() * 8)], log

        # reduce: fwd all-reduce, bwd identity
        with M.record_collectives() as log:
            y, gx = _fwd_bwd(lambda t: M.reduce_from_tensor_parallel_region(t, group), x, ws[r])
        _check(y, sum(xs), f"reduce fwd tp={tp}")
        _check(gx, ws[r], f"reduce bwd tp={tp}")
        assert [e.op for e in log] == ["all_reduce"]
        assert torch.equal(x, xs[r]), "reduce must not modify its input in place"

        # scatter last dim: fwd own slice, bwd all-gather
        k = shape[-1] // tp
        ws_s = [_val(3, i, (4, 3, k)) for i in range(tp)]
        with M.record_collectives() as log:
            y, gx = _fwd_bwd(lambda t: M.scatter_to_tensor_parallel_region(t, group), x, ws_s[r])
        _check(y, x[..., r * k:(r + 1) * k], f"scatter fwd tp={tp}")
        _check(gx, torch.cat(ws_s, dim=-1), f"scatter bwd tp={tp}")
        assert [(e.op, e.numel) for e in log] == [("all_gather", 4 * 3 * k)]

        # gather last dim: fwd all-gather, bwd own slice
        ws_g = [_val(4, i, (4, 3, 8 * tp)) for i in range(tp)]
        with M.record_collectives() as log:
            y, gx = _fwd_bwd(lambda t: M.gather_from_tensor_parallel_region(t, group), x, ws_g[r])
        _check(y, torch.cat(xs, dim=-1), f"gather fwd tp={tp}")
        _check(gx, ws_g[r][..., r * 8:(r + 1) * 8], f"gather bwd tp={tp}")
        assert [(e.op, e.numel) for e in log] == [("all_gather", x.numel())]

        for dim in (0, 1):
            n = shape[dim]
            # sequence scatter: fwd own slice of dim, bwd all-gather
            xs_sp = [_val(5, i, (8, 4, 2)) for i in range(tp)]
            kk = 8 // tp if dim == 0 else 4 // tp
            wshape = (kk, 4, 2) if dim == 0 else (8, kk, 2)
            ws_sp = [_val(6, i, wshape) for i in range(tp)]
            y, gx = _fwd_bwd(lambda t: M.scatter_to_sequence_parallel_region(t, group, dim), xs_sp[r], ws_sp[r])
            _check(y, xs_sp[r].narrow(dim, r * kk, kk), f"sp scatter fwd dim={dim} tp={tp}")
            _check(gx, torch.cat(ws_sp, dim=dim), f"sp scatter bwd dim={dim} tp={tp}")

            # sequence gather: fwd all-gather dim, bwd reduce-scatter
            ws_full = [_val(7, i, tuple(s * tp if d == dim else s for d, s in enumerate(shape))) for i in range(tp)]
            with M.record_collectives() as log:
                y, gx = _fwd_bwd(lambda t: M.gather_from_sequence_parallel_region(t, group, dim), x, ws_full[r])
            _check(y, torch.cat(xs, dim=dim), f"sp gather fwd dim={dim} tp={tp}")
            _check(gx, sum(ws_full).narrow(dim, r * n, n), f"sp gather bwd dim={dim} tp={tp}")
            assert [e.op for e in log] == ["all_gather", "reduce_scatter"]

            # reduce-scatter: fwd reduce-scatter dim, bwd all-gather
            xs_big = ws_full
            ws_small = [_val(8, i, shape) for i in range(tp)]
            y, gx = _fwd_bwd(lambda t: M.reduce_scatter_to_sequence_parallel_region(t, group, dim),
                             xs_big[r], ws_small[r])
            _check(y, sum(xs_big).narrow(dim, r * n, n), f"reduce-scatter fwd dim={dim} tp={tp}")
            _check(gx, torch.cat(ws_small, dim=dim), f"reduce-scatter bwd dim={dim} tp={tp}")

        # all_reduce max through the internal entry point
        t = torch.tensor([float(r), -float(r)])
        M.all_reduce(t, group, op="max")
        assert t.tolist() == [tp - 1.0, 0.0]

        # fallback paths when the backend lacks the fused collectives
        saved = (M._all_gather_single, M._reduce_scatter_single)

        def _unsupported(*a, **k):
            raise RuntimeError("this collective is not supported by the backend")

        try:
            M._unsupported.clear()
            M._all_gather_single = _unsupported
            M._reduce_scatter_single = _unsupported
            _check(M.all_gather(x, group, dim=1), torch.cat(xs, dim=1), "all_gather fallback")
            big = torch.cat([x] * tp, dim=0)
            _check(M.reduce_scatter(big, group, dim=0), sum(xs), "reduce_scatter fallback")
            assert torch.equal(big, torch.cat([x] * tp, dim=0)), "fallback must not modify its input"
            assert M._unsupported == {"all_gather", "reduce_scatter"}
        finally:
            M._all_gather_single, M._reduce_scatter_single = saved
            M._unsupported.clear()

        # nested recorders both see the collective; a closed recorder sees nothing more
        with M.record_collectives() as outer:
            with M.record_collectives() as inner:
                M.all_reduce(torch.zeros(3), group)
            M.all_reduce(torch.zeros(5), group)
        M.all_reduce(torch.zeros(7), group)
        assert [e.numel for e in inner] == [3] and [e.numel for e in outer] == [3, 5]
    return True


def _check_shared_input_copy(rank, world):
    for tp, group in _tp_groups():
        r = dist.get_rank(group)
        x0 = _val(9, 0, (3, 8))  # the same input on every rank
        ws = [[_val(10 + j, i, (8, 8)) for j in range(3)] for i in range(tp)]  # rank-specific "weights"

        shared = M.SharedInputCopy(group)
        x = x0.clone().requires_grad_(True)
        with M.record_collectives() as log:
            ys = [shared(x) for _ in range(3)]
            assert ys[0] is ys[1] is ys[2], "same input must give the same copy"
            loss = sum((y @ w).sum() for y, w in zip(ys, ws[r]))
            n_fwd = len(log)
            loss.backward()
        assert n_fwd == 0
        assert [(e.op, e.numel) for e in log] == [("all_reduce", x.numel())], log
        # reference: d/dx sum_ranks sum_j (x @ w_ij).sum()
        xr = x0.clone().requires_grad_(True)
        sum((xr @ w).sum() for i in range(tp) for w in ws[i]).backward()
        _check(x.grad, xr.grad, f"shared copy grad tp={tp}")

        # without sharing: three all-reduces (the cost SharedInputCopy removes)
        x2 = x0.clone().requires_grad_(True)
        with M.record_collectives() as log:
            sum((M.copy_to_tensor_parallel_region(x2, group) @ w).sum() for w in ws[r]).backward()
        assert [e.op for e in log] == ["all_reduce"] * 3
        _check(x2.grad, xr.grad, "unshared copy grad")

        # another tensor -> new copy; in-place change of the input -> new copy
        a = x0.clone().requires_grad_(True)
        b = x0.clone().requires_grad_(True)
        ya = shared(a)
        assert shared(b) is not ya
        c = x0.clone()
        yc = shared(c)
        c.add_(1)
        assert shared(c) is not yc
        # no_grad: plain pass-through
        with torch.no_grad():
            assert shared(a) is a
        # the memo does not keep the input's graph alive forever
        import gc
        import weakref

        d = x0.clone().requires_grad_(True)
        e = d * 2
        shared(e)
        ref = weakref.ref(e)
        del e
        gc.collect()
        shared(x0.clone().requires_grad_(True))  # replaces the memo
        gc.collect()
        assert ref() is None
        import copy

        assert copy.deepcopy(shared).group is group
    return True


def _all_checks(rank, world):
    return _check_collectives(rank, world) and _check_shared_input_copy(rank, world)


def test_collectives_and_shared_input_copy_tp2_and_tp4():
    # one spawn (about 7 s on a small CI box) for every distributed check of this file
    assert run_distributed(_all_checks, 4) == [True] * 4


def test_world_size_one_is_identity_without_dist():
    if dist.is_initialized() and dist.get_world_size() != 1:
        pytest.skip("needs a process without a multi-rank default group")
    x = torch.randn(4, 6, requires_grad=True)
    with M.record_collectives() as log:
        for f in (M.copy_to_tensor_parallel_region, M.reduce_from_tensor_parallel_region,
                  M.scatter_to_tensor_parallel_region, M.gather_from_tensor_parallel_region,
                  M.scatter_to_sequence_parallel_region, M.gather_from_sequence_parallel_region,
                  M.reduce_scatter_to_sequence_parallel_region):
            assert f(x, None) is x
        assert M.SharedInputCopy(None)(x) is x
    assert log == []
