"""One forward on random token ids (megastrategy.layers.random_ids_forward)."""
from __future__ import annotations

import torch

from megastrategy.layers.random_ids_forward import forward_on_random_ids
from tests.helpers.hf_zoo import tiny_model


def test_the_same_ids_every_time_and_the_users_rng_untouched():
    model = tiny_model("llama")
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].clone()), with_kwargs=True)
    torch.manual_seed(7)
    state = torch.get_rng_state()
    forward_on_random_ids(model)
    forward_on_random_ids(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert seen[0].shape == (2, 8) and torch.equal(seen[0], seen[1]) and int(seen[0].min()) >= 3
