import torch
import torch.distributed as dist
from torch import nn

from megastrategy.ddp.grad_buffer import GradientBuffer
from tests.helpers.dist import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(rank, micro):
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(3, 4, generator=g)


def _reduce_matches_mean_of_replicas(rank, world_size, bucket_numel, dtype):
    model = _model().to(dtype)
    buf = GradientBuffer(model.parameters(), group=dist.group.WORLD, bucket_numel=bucket_numel)
    for micro in range(2):  # two accumulated backward passes
        model(_data(rank, micro).to(dtype)).pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters()), "grads must live in main_grad only"
    buf.reduce()
    buf.expose_grads()
    got = [p.grad.detach().float().clone() for p in model.parameters()]
    # reference: every replica's grads, summed over micro-batches, averaged over ranks
    ref = _model()
    ref_grads = [torch.zeros_like(p) for p in ref.parameters()]
    for r in range(world_size):
        ref.zero_grad()
        for micro in range(2):
            ref(_data(r, micro)).pow(2).sum().backward()
        for acc, p in zip(ref_grads, ref.parameters()):
            acc += p.grad / world_size
    buf.zero()
    zeroed = all(float(p.main_grad.abs().sum()) == 0.0 for p in model.parameters())
    return len(buf.buckets), [float((a - b).abs().max()) for a, b in zip(got, ref_grads)], zeroed


def test_reduce_averages_accumulated_grads_over_dp_in_one_bucket():
    for buckets, errs, zeroed in run_distributed(_reduce_matches_mean_of_replicas, 2, 10**9, torch.float32):
        assert buckets == 1 and max(errs) < 1e-6 and zeroed


def test_small_buckets_and_bf16_params_accumulate_in_fp32():
    out = run_distributed(_reduce_matches_mean_of_replicas, 2, 10, torch.bfloat16)
    for buckets, errs, zeroed in out:
        assert buckets > 1
        assert max(errs) < 5e-2  # bf16 forward; the buffer itself is fp32
        assert zeroed


def test_buffer_is_fp32_and_contiguous_and_ties_count_once():
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head}).to(torch.bfloat16)
    buf = GradientBuffer(list(emb.parameters()) + list(head.parameters()), group=None)
    assert buf.numel == 15 and list(buf.buffers) == [torch.float32]
    assert emb.weight.main_grad.data_ptr() == head.weight.main_grad.data_ptr()
    model["head"](model["emb"](torch.tensor([1, 2]))).float().sum().backward()
    assert emb.weight.main_grad.abs().sum() > 0 and buf.has_grads
