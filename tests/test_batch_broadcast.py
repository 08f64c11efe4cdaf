import torch
import torch.distributed as dist

from megastrategy.batch_broadcast import BatchBroadcaster
from tests.helpers.dist import run_distributed


def _broadcast(rank, world_size):
    # every rank draws a different "random" batch, as a masking collate function would
    g = torch.Generator().manual_seed(rank)
    batch = {"input_ids": torch.randint(0, 9, (2, 3), generator=g), "meta": ["a", rank], "x": (torch.rand(2, generator=g),)}
    out = BatchBroadcaster(src=0, group=dist.group.WORLD, device=torch.device("cpu"))(batch)
    return out["input_ids"].tolist(), out["meta"], out["x"][0].tolist()


def test_every_rank_gets_rank0s_batch():
    results = run_distributed(_broadcast, 3)
    assert all(r == results[0] for r in results)
    assert results[0][1] == ["a", 0]
