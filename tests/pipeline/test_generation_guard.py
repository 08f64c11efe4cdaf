"""``generate()`` on a pipelined Hugging Face model is refused by name, with what works instead,
rather than failing deep in a stage on a module it does not hold."""
import pytest
import torch
import transformers

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.generation_guard import refuse_generation
from tests.helpers.causal_lm_steps import tiny_llama_config


def test_generate_is_refused_naming_the_model_and_what_works():
    holder = torch.nn.Module()
    holder.lm = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    refuse_generation(holder, pp=2)
    with pytest.raises(MegatronConfigError, match=r"lm\.generate\(\) with pp=2.*pp=1.*tp"):
        holder.lm.generate(input_ids=torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2)
    assert torch.is_tensor(holder.lm(input_ids=torch.zeros(1, 4, dtype=torch.long)).logits)  # the forward is untouched
