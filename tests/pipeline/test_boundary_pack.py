"""Several tensors cross a stage boundary as one: exact sizes and values, gradients to each."""
import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.boundary_pack import pack, unpack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_then_unpack_gives_back_every_tensor_with_its_size_and_dtype(dtype):
    hidden = torch.randn(2, 300, 8, dtype=dtype)  # 300 > 256: sizes bf16 could not hold as one number
    bias = torch.randn(1, 4, 300, 300, dtype=torch.float32)
    flat = pack([hidden, bias])
    back = unpack(flat, 2)
    assert [t.shape for t in back] == [hidden.shape, bias.shape]
    assert back[0].dtype == dtype and back[1].dtype == torch.float32
    assert torch.equal(back[0], hidden) and torch.equal(back[1], bias)  # packed as float32: exact


def test_gradients_flow_from_the_received_tensor_to_every_packed_tensor():
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(2, 2, 5, requires_grad=True)
    received = pack([a * 1, b * 1]).detach().requires_grad_(True)  # what the next stage gets
    x, y = unpack(received, 2)
    (x.sum() * 2 + (y * 3).sum()).backward()
    sent = pack([a * 1, b * 1])
    torch.autograd.backward(sent, received.grad)
    assert torch.equal(a.grad, torch.full_like(a, 2.0)) and torch.equal(b.grad, torch.full_like(b, 3.0))


def test_a_tensor_that_cannot_be_carried_is_refused_naming_it():
    with pytest.raises(MegatronConfigError, match="dtype torch.bool"):
        pack([torch.randn(2, 3), torch.zeros(2, dtype=torch.bool)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_integer_tensors_cross_bit_for_bit_beside_any_float_dtype(dtype):
    """A sparse-attention indexer's top-k indices (int32, past bfloat16's exact 256) and int64 values
    beyond float32's 2**24, in odd counts (padded to whole elements of the packed dtype)."""
    hidden = torch.randn(2, 3, dtype=dtype, requires_grad=True)
    indices = torch.randint(0, 100_000, (2, 5, 3), dtype=torch.int32)
    big = torch.tensor([2**40 + 3, -7, 5])
    got_hidden, got_indices, got_big = unpack(pack([hidden, indices, big]), 3)
    assert torch.equal(got_indices, indices) and got_indices.dtype == torch.int32
    assert torch.equal(got_big, big) and got_big.dtype == torch.int64
    got_hidden.float().sum().backward()  # the float part still carries its gradient
    assert torch.equal(hidden.grad, torch.ones_like(hidden))
