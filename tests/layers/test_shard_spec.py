import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.shard_spec import (
    ShardSpec,
    get_shard_spec,
    merge_shards,
    padded_size_for,
    set_shard_spec,
    shard_full_tensor,
)


def test_plain_split_dim0_and_dim1():
    full = torch.arange(24.0).view(6, 4)
    spec0 = ShardSpec(dim=0, full_size=6, padded_size=6)
    shards = [shard_full_tensor(full, spec0, r, 3) for r in range(3)]
    assert torch.equal(shards[1], full[2:4])
    assert torch.equal(merge_shards(shards, spec0), full)

    spec1 = ShardSpec(dim=1, full_size=4, padded_size=4)
    shards = [shard_full_tensor(full, spec1, r, 2) for r in range(2)]
    assert torch.equal(shards[0], full[:, :2]) and torch.equal(shards[1], full[:, 2:])
    assert torch.equal(merge_shards(shards, spec1), full)

    spec_neg = ShardSpec(dim=-1, full_size=4, padded_size=4)
    assert torch.equal(shard_full_tensor(full, spec_neg, 1, 2), full[:, 2:])


def test_padding_is_zero_and_stripped():
    full = torch.arange(1.0, 38.0).view(37, 1).expand(37, 3).contiguous()  # no zero rows
    tp = 4
    padded = padded_size_for(37, tp)
    assert padded == 40
    spec = ShardSpec(dim=0, full_size=37, padded_size=padded)
    shards = [shard_full_tensor(full, spec, r, tp) for r in range(tp)]
    assert all(s.shape == (10, 3) for s in shards)
    assert torch.equal(shards[0], full[:10])
    assert torch.equal(shards[3][:7], full[30:])
    assert torch.count_nonzero(shards[3][7:]) == 0  # 3 padding rows
    assert torch.equal(merge_shards(shards, spec), full)


def test_packed_qkv_gives_each_rank_its_q_k_v():
    h, tp = 4, 2
    q = torch.full((h, h), 1.0) + torch.arange(h).view(h, 1)
    k = torch.full((h, h), 10.0) + torch.arange(h).view(h, 1)
    v = torch.full((h, h), 100.0) + torch.arange(h).view(h, 1)
    full = torch.cat([q, k, v])  # [3h, h]
    spec = ShardSpec(dim=0, full_size=3 * h, padded_size=3 * h, packed_chunks=3)
    for r in range(tp):
        sl = slice(r * h // tp, (r + 1) * h // tp)
        expect = torch.cat([q[sl], k[sl], v[sl]])
        assert torch.equal(shard_full_tensor(full, spec, r, tp), expect)
    shards = [shard_full_tensor(full, spec, r, tp) for r in range(tp)]
    assert torch.equal(merge_shards(shards, spec), full)
    # a 1-D packed bias and a packed dim 1 round-trip too
    bias = torch.arange(12.0)
    assert torch.equal(shard_full_tensor(bias, spec, 1, 2), torch.tensor([2.0, 3, 6, 7, 10, 11]))
    spec1 = ShardSpec(dim=1, full_size=12, padded_size=12, packed_chunks=3)
    full_t = full.t().contiguous()
    shards = [shard_full_tensor(full_t, spec1, r, 2) for r in range(2)]
    assert torch.equal(merge_shards(shards, spec1), full_t)


def test_packed_with_padding_pads_each_chunk():
    full = torch.arange(1.0, 10.0)  # 3 chunks of 3, padded to 4 each for tp=2
    spec = ShardSpec(dim=0, full_size=9, padded_size=padded_size_for(9, 2, packed_chunks=3), packed_chunks=3)
    assert spec.padded_size == 12
    s0 = shard_full_tensor(full, spec, 0, 2)
    s1 = shard_full_tensor(full, spec, 1, 2)
    assert torch.equal(s0, torch.tensor([1.0, 2, 4, 5, 7, 8]))
    assert torch.equal(s1, torch.tensor([3.0, 0, 6, 0, 9, 0]))
    assert torch.equal(merge_shards([s0, s1], spec), full)


def test_errors():
    full = torch.zeros(6, 2)
    with pytest.raises(MegatronConfigError, match="does not divide"):
        shard_full_tensor(full, ShardSpec(0, 6, 6), 0, 4)
    with pytest.raises(ValueError, match="full_size"):
        shard_full_tensor(full, ShardSpec(0, 5, 6), 0, 2)
    with pytest.raises(MegatronConfigError):
        ShardSpec(0, 7, 6)
    with pytest.raises(MegatronConfigError):
        ShardSpec(0, 7, 8, packed_chunks=3)
    with pytest.raises(ValueError, match="shard 1"):
        merge_shards([torch.zeros(3, 2), torch.zeros(2, 2)], ShardSpec(0, 6, 6))


def test_set_get_and_frozen():
    p = torch.nn.Parameter(torch.zeros(2))
    assert get_shard_spec(p) is None
    spec = ShardSpec(0, 4, 4)
    set_shard_spec(p, spec)
    assert get_shard_spec(p) is spec
    with pytest.raises(Exception):
        spec.dim = 1  # frozen
    with pytest.raises(TypeError):
        set_shard_spec(p, (0, 4, 4))
