"""One forward on random token ids (megastrategy.layers.random_ids_forward)."""
from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("arch, task, key, shape", [
    ("vit", "img", "pixel_values", (2, 3, 16, 16)),  # image_size 16
    ("wav2vec2", "audio", "input_values", (2, 160)),  # 16 frames after strides 5 and 2
    ("whisper", "lm", "input_features", (2, 8, 32)),  # 8 mel bins, 2 * max_source_positions
])
def test_vision_and_audio_models_get_their_main_input(arch, task, key, shape):
    model = tiny_model(arch, task=task)
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    forward_on_random_ids(model)
    assert tuple(seen[0][key].shape) == shape and seen[0][key].is_floating_point()
