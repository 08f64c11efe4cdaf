"""``save_pretrained()`` on a model the rank holds only a share of is refused with what writes the
whole model; on an unsplit layout (dp only) it stays Hugging Face's own."""
from types import SimpleNamespace

import pytest
import torch
import transformers

from megastrategy.checkpoint.save_pretrained_guard import refuse_partial_save_pretrained, sharding_of
from megastrategy.errors import MegatronConfigError
from tests.helpers.causal_lm_steps import tiny_llama_config


def _holder() -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    return holder


def test_sharding_names_only_the_dimensions_that_split_the_model():
    assert sharding_of(SimpleNamespace(tp_size=2, pp_size=2, ep_size=1)) == "tp=2, pp=2"
    assert sharding_of(SimpleNamespace(tp_size=1, pp_size=1, ep_size=1)) == ""


def test_save_pretrained_of_a_shard_is_refused_naming_export_hf(tmp_path):
    holder = _holder()
    refuse_partial_save_pretrained(holder, "tp=2")
    with pytest.raises(MegatronConfigError, match=r"model\.save_pretrained\(\) with tp=2.*export_hf\('out_dir'\).*every rank"):
        holder.model.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())


def test_an_unsplit_model_saves_as_usual(tmp_path):
    holder = _holder()
    refuse_partial_save_pretrained(holder, "")
    holder.model.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").is_file()
