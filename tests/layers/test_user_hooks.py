"""The user's hooks on layers the tp plan shards are refused by name before the split (layers/user_hooks.py);
hooks on layers kept whole, and libraries' own hooks, are let through."""
import pytest
import torch

from megastrategy.errors import MegatronConfigError
from megastrategy.layers.plan import resolve_tp_plan
from megastrategy.layers.user_hooks import refuse_user_hooks
from tests.helpers.models import GPT


def _refuse(model, plan=GPT.TP_PLAN):
    refuse_user_hooks(model, resolve_tp_plan(model, plan, 2), 2)


def _message(model, plan=GPT.TP_PLAN) -> str:
    with pytest.raises(MegatronConfigError) as raised:
        _refuse(model, plan)
    return str(raised.value)


def test_pruning_a_sharded_layer_is_refused_naming_prune_remove():
    model = GPT()
    torch.nn.utils.prune.l1_unstructured(model.blocks[1].out, "weight", amount=0.3)
    message = _message(model)
    assert message.startswith("tp=2: 'blocks.1.out' has torch.nn.utils.prune's L1Unstructured on 'weight', and the "
                              "plan shards 'blocks.1.out' (row, from tp_plan['blocks.*.out'])")
    assert "prune.remove(module, 'weight')" in message and "tp_plan={'blocks.1.out': 'replicate'}" in message


@pytest.mark.parametrize("register", ["register_forward_hook", "register_forward_pre_hook",
                                      "register_full_backward_hook", "register_full_backward_pre_hook"])
def test_module_hooks_on_a_sharded_layer_are_refused(register):
    model = GPT()
    getattr(model.blocks[0].q, register)(lambda *a: None)
    message = _message(model)
    assert "'blocks.0.q' has a" in message and "the block around it" in message


@pytest.mark.parametrize("register", ["register_hook", "register_post_accumulate_grad_hook"])
def test_gradient_hooks_on_a_sharded_parameter_are_refused(register):
    model = GPT()
    getattr(model.blocks[0].fc.bias, register)(lambda g: None)
    message = _message(model)
    assert "'blocks.0.fc.bias' has a" in message and "the block around it" not in message


def test_hooks_on_layers_kept_whole_and_libraries_hooks_pass():
    from megastrategy.layers import user_hooks as library

    model = GPT()
    model.blocks[0].register_forward_hook(lambda *a: None)  # the block itself is not sharded
    model.blocks[0].ln1.weight.register_hook(lambda g: g)
    model.blocks[0].fc.register_forward_hook(library._origin)  # a library's own hook
    torch.nn.utils.prune.l1_unstructured(model.blocks[1].fc, "weight", amount=0.3)
    _refuse(model, {**GPT.TP_PLAN, "blocks.*.fc": "replicate", "blocks.*.out": "replicate"})
