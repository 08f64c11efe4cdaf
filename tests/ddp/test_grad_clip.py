import torch
import torch.distributed as dist
from torch import nn

from megastrategy.ddp.grad_clip import clip_grad_norm_
from tests.helpers.dist import run_distributed


def _clip_on_sharded_model(rank, world_size):
    torch.manual_seed(0)
    full_w = torch.randn(6, 4)
    full_b = torch.randn(4)  # replicated over the two "TP" ranks
    w = nn.Parameter(full_w[rank * 3 : (rank + 1) * 3].clone())
    b = nn.Parameter(full_b.clone())
    w.grad, b.grad = w.detach().clone(), b.detach().clone()
    sharded = {id(w)}
    norm = clip_grad_norm_(
        [w, b], 1.0, counts_here=lambda p: id(p) in sharded or rank == 0, group=dist.group.WORLD
    )
    # serial reference
    rw, rb = nn.Parameter(full_w.clone()), nn.Parameter(full_b.clone())
    rw.grad, rb.grad = full_w.clone(), full_b.clone()
    ref = torch.nn.utils.clip_grad_norm_([rw, rb], 1.0)
    return float(norm), float(ref), float((w.grad - rw.grad[rank * 3 : (rank + 1) * 3]).abs().max()), float((b.grad - rb.grad).abs().max())


def test_clip_uses_the_global_norm_counting_replicated_params_once():
    for norm, ref, err_w, err_b in run_distributed(_clip_on_sharded_model, 2):
        assert abs(norm - ref) < 1e-5 and err_w < 1e-6 and err_b < 1e-6
