"""A tree of tensors broadcast from one rank arrives intact in two messages (header, packed payload),
whatever its dtypes, shapes and layout; a header too long for one message takes a second one."""
import pytest
import torch
import torch.distributed as dist

from megastrategy.errors import MegatronConfigError
from megastrategy.tree_broadcast import TreeBroadcast
from tests.helpers.dist import run_distributed


def _tree(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)  # the receivers' own values must not leak into the result
    return {
        "ids": torch.randint(0, 9, (2, 3), generator=g),
        "half": torch.rand(3, 5, generator=g).to(torch.bfloat16),
        "strided": torch.rand(4, 6, generator=g)[:, ::2],  # not contiguous
        "mask": torch.rand(5, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(float(rank)),
        "text": ["a", rank],
    }


def _many(rank: int) -> list:  # 30 three-dimensional tensors: 2 + 30 * 7 header ints, past one message
    return [torch.full((1, 2, i + 1), float(rank * 100 + i)) for i in range(30)]


def _as_lists(tree) -> list:
    leaves = tree.values() if isinstance(tree, dict) else tree
    return [(x.dtype, x.tolist()) if isinstance(x, torch.Tensor) else x for x in leaves]


def _broadcast(rank, world):
    calls, plain_broadcast = [], dist.broadcast

    def counting(*args, **kwargs):
        calls.append(1)
        return plain_broadcast(*args, **kwargs)

    dist.broadcast = counting  # this worker process only
    send = TreeBroadcast(group=dist.group.WORLD, src=0, device=torch.device("cpu"), what="test")
    got, messages = [], []
    for make in (_tree, _tree, _many):
        before = len(calls)
        got.append(_as_lists(send(make(rank) if rank == 0 else None)))
        messages.append(len(calls) - before)
    error = None
    if rank == 0:  # refused before anything is sent, so the other ranks do not take part
        try:
            send({"x": torch.zeros(2, dtype=torch.uint16)})
        except MegatronConfigError as e:
            error = str(e)
    return got, messages, error


@pytest.mark.timeout(120)
def test_every_rank_gets_the_source_tree_in_two_messages():
    results = run_distributed(_broadcast, 3, timeout=90)
    expected = [_as_lists(_tree(0)), _as_lists(_tree(0)), _as_lists(_many(0))]
    for got, messages, _ in results:
        assert got == expected
        # the first tree also pickles its structure (broadcast_object_list); then header + payload;
        # 30 tensors need a second header message
        assert messages[1] == 2 and messages[2] == 3
    assert "torch.uint16" in results[0][2] and "supported dtypes" in results[0][2]
