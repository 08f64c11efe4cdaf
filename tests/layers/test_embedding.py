"""VocabParallelEmbedding vs nn.Embedding at tp=2 (two subgroups of a 4-process world)
and tp=4, with vocab sizes tp does not divide, in ONE spawn."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.embedding import VocabParallelEmbedding
from megastrategy.layers.mappings import record_collectives
from megastrategy.layers.shard_spec import ShardSpec, get_shard_spec, merge_shards, shard_full_tensor
from tests.helpers.dist import run_distributed



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


def _compare(tp, group, vocab, dim, padding_idx, ids):
    r = dist.get_rank(group)
    torch.manual_seed(vocab + dim)
    emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
    if padding_idx is not None:
        with torch.no_grad():  # "whatever the user had" in the padding row is kept
            emb.weight[padding_idx] = 0.5
    G = torch.randn(*ids.shape, dim)
    ref = emb(ids)
    (ref * G).sum().backward()

    pe = VocabParallelEmbedding.from_embedding(emb, group=group)
    padded = -(-vocab // tp) * tp
    per = padded // tp
    assert pe.num_embeddings == vocab and pe.padded_num_embeddings == padded
    assert (pe.vocab_start_index, pe.vocab_end_index) == (r * per, (r + 1) * per)
    assert pe.weight.shape == (per, dim)
    spec = get_shard_spec(pe.weight)
    assert spec == ShardSpec(dim=0, full_size=vocab, padded_size=padded)
    _close(pe.weight, shard_full_tensor(emb.weight, spec, r, tp), "embedding rows are the user's")
    n_pad_local = max(0, (r + 1) * per - vocab)
    if n_pad_local:
        assert torch.count_nonzero(pe.weight[per - n_pad_local:]) == 0, "padding rows must be zero"

    with record_collectives() as log:
        out = pe(ids)
        (out * G).sum().backward()
    _close(out, ref, f"embedding output V={vocab} tp={tp}")
    _close(pe.weight.grad, shard_full_tensor(emb.weight.grad, spec, r, tp), f"embedding grad V={vocab} tp={tp}")
    assert [(e.op, e.numel) for e in log] == [("all_reduce", out.numel())], log
    if padding_idx is not None and pe.vocab_start_index <= pe.padding_idx < pe.vocab_end_index:
        assert torch.count_nonzero(pe.weight.grad[pe.padding_idx - pe.vocab_start_index]) == 0
    # the full table round-trips
    shards = [torch.empty_like(pe.weight) for _ in range(tp)]
    dist.all_gather(shards, pe.weight.detach().contiguous(), group=group)
    _close(merge_shards(shards, spec), emb.weight, "merged table")


def _all_checks(rank, world):
    for tp, group in _tp_groups():
        g = torch.Generator().manual_seed(1)
        ids37 = torch.cat([torch.arange(37), torch.randint(0, 37, (11,), generator=g)]).view(4, 12)
        ids37[0, 3] = 5  # the padding index appears in the batch
        _compare(tp, group, 37, 6, 5, ids37)
        _compare(tp, group, 37, 6, None, ids37)
        _compare(tp, group, 37, 6, -1, ids37)  # negative padding_idx like nn.Embedding
        ids_big = torch.tensor([[0, 1, 30521, 7630, 7631, 15261], [22891, 22892, 30520, 101, 102, 30521]])
        _compare(tp, group, 30522, 2, 0, ids_big)

        # plain constructor: same init as nn.Embedding for the same seed, whatever tp is
        r = dist.get_rank(group)
        torch.manual_seed(7)
        pe = VocabParallelEmbedding(37, 6, group=group, padding_idx=3)
        torch.manual_seed(7)
        emb = nn.Embedding(37, 6, padding_idx=3)
        assert torch.equal(pe.weight, shard_full_tensor(emb.weight, get_shard_spec(pe.weight), r, tp))
        assert "padded" in repr(pe)
        with torch.no_grad():  # inference path
            _close(pe(ids37), emb(ids37), "no_grad forward")
    return True


def test_vocab_parallel_embedding_tp2_and_tp4():
    assert run_distributed(_all_checks, 4) == [True] * 4


def test_unsupported_embedding_options_are_rejected():
    for kw in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        with pytest.raises(MegatronConfigError, match=next(iter(kw))):
            VocabParallelEmbedding.from_embedding(nn.Embedding(10, 4, **kw), group=None)
    with pytest.raises(MegatronConfigError, match="padding_idx"):
        VocabParallelEmbedding(10, 4, group=None, padding_idx=10)


def test_world_size_one_matches_serial_without_dist():
    emb = nn.Embedding(11, 3, padding_idx=2)
    pe = VocabParallelEmbedding.from_embedding(emb, group=None)
    ids = torch.tensor([[0, 2, 10], [2, 5, 1]])
    torch.testing.assert_close(pe(ids), emb(ids))
    pe(ids).sum().backward()
    assert torch.count_nonzero(pe.weight.grad[2]) == 0
    # dtype and requires_grad of the source are kept; the weight is a copy
    emb64 = nn.Embedding(11, 3, dtype=torch.float64)
    emb64.weight.requires_grad_(False)
    pe64 = VocabParallelEmbedding.from_embedding(emb64, group=None)
    assert pe64.weight.dtype == torch.float64 and not pe64.weight.requires_grad
    assert pe64.weight.data_ptr() != emb64.weight.data_ptr()
    torch.testing.assert_close(pe64(ids), emb64(ids))
