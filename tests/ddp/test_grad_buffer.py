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


def _three_passes(model, buffer):
    xs = [torch.full((2, 3), v) for v in (1.0, -2.0, 0.5)]
    for x in xs:
        model(x).pow(2).sum().backward()
    return xs


def test_gradient_views_accumulate_in_the_buffer_and_end_with_no_grad():
    """Inside gradient_views (a pipeline's microbatches) .grad is main_grad after the first pass,
    so autograd adds the later passes into the buffer itself; the sums equal the hook-only path."""
    torch.manual_seed(0)
    ref, viewed = nn.Linear(3, 2), nn.Linear(3, 2)
    viewed.load_state_dict(ref.state_dict())
    ref_buffer, buffer = GradientBuffer(ref.parameters(), group=None), GradientBuffer(viewed.parameters(), group=None)
    _three_passes(ref, ref_buffer)
    with buffer.gradient_views():
        _three_passes(viewed, buffer)
        assert all(p.grad is p.main_grad for p in viewed.parameters())
    assert all(p.grad is None for p in viewed.parameters())
    for p, q in zip(ref.parameters(), viewed.parameters()):
        torch.testing.assert_close(q.main_grad, p.main_grad, rtol=0, atol=0)


def test_gradient_views_leave_a_bf16_parameter_to_the_hook():
    """A parameter whose dtype differs from the fp32 buffer cannot hold a view of it as .grad."""
    model = nn.Linear(3, 2).to(torch.bfloat16)
    buffer = GradientBuffer(model.parameters(), group=None)
    with buffer.gradient_views():
        for v in (1.0, 2.0):
            model(torch.full((2, 3), v, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        assert all(p.grad is None for p in model.parameters())
    assert model.weight.main_grad.dtype == torch.float32 and model.weight.main_grad.abs().sum() > 0
