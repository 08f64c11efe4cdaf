"""The user's ``torch.nn.utils.clip_grad_norm_`` while the strategy trains: the model's parameters
go to the global-norm clip, anything else to torch's own; torch's function is back afterwards."""
import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad

from megastrategy.ddp.user_clip import UserNormClipping, refuse_without_visible_grads
from megastrategy.errors import MegatronConfigError


def _with_grads(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = torch.full_like(p, 3.0)


def test_the_models_parameters_go_to_the_global_clip_others_to_torch():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    _with_grads(model, other)
    seen = []

    def clip(params, max_norm, norm_type):
        seen.append((len(params), max_norm, norm_type))
        return torch.tensor(7.0)

    original = torch.nn.utils.clip_grad_norm_
    clipping = UserNormClipping(lambda: {id(p) for p in model.parameters()}, clip)
    clipping.install()
    try:
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item() == 7.0
        assert clip_grad.clip_grad_norm_(model.weight, 0.5, norm_type=1.0).item() == 7.0
        assert seen == [(2, 1.0, 2.0), (1, 0.5, 1.0)]
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)  # torch's own: clipped locally
        assert seen == [(2, 1.0, 2.0), (1, 0.5, 1.0)] and other.weight.grad.norm() < 3.0
        with pytest.raises(RuntimeError, match="non-finite"):
            UserNormClipping(lambda: {id(model.weight)}, lambda *a: torch.tensor(float("inf"))).clip_grad_norm_(
                [model.weight], 1.0, error_if_nonfinite=True)
    finally:
        clipping.remove()
    assert torch.nn.utils.clip_grad_norm_ is original and clip_grad.clip_grad_norm_ is original


def test_without_visible_grads_the_call_is_refused_naming_lightnings_clipping():
    refuse_without_visible_grads(False)
    with pytest.raises(MegatronConfigError, match="gradient_clip_val"):
        refuse_without_visible_grads(True)
