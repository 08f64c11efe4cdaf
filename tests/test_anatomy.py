"""Where the layer stack is: the user's pipeline_layers, else the config's base_model_pp_plan, else
the longest list of identical blocks."""
import pytest
import transformers
from torch import nn

from megastrategy.anatomy import find_layer_stack, pp_plan_stack
from megastrategy.errors import MegatronConfigError

TINY = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            num_key_value_heads=1, max_position_embeddings=32)


class WithProbes(nn.Module):
    """A user module holding a Llama and a longer list of identical probes beside it."""

    def __init__(self):
        super().__init__()
        self.probes = nn.ModuleList(nn.Linear(16, 1) for _ in range(6))
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))


def test_base_model_pp_plan_names_the_stack_before_the_longest_list():
    module = WithProbes()
    assert pp_plan_stack(module) == "model.model.layers"
    path, stack = find_layer_stack(module)
    assert path == "model.model.layers" and stack is module.model.model.layers


def test_pipeline_layers_overrides_the_plan():
    module = WithProbes()
    assert find_layer_stack(module, "probes")[1] is module.probes
    with pytest.raises(MegatronConfigError, match="pipeline_layers='model.nope'"):
        find_layer_stack(module, "model.nope")


def test_without_a_plan_the_longest_list_of_identical_blocks_is_the_stack():
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}))
    assert pp_plan_stack(bert) is None
    assert find_layer_stack(bert)[0] == "bert.encoder.layer"


def test_a_list_mixing_kinds_of_blocks_is_named_with_the_fix_not_taken_silently():
    """Jamba (no base_model_pp_plan): Mamba and attention layers in one list; pp works once it is named."""
    from tests.helpers.hf_zoo import tiny_model

    jamba = tiny_model("jamba")
    with pytest.raises(MegatronConfigError, match="mixes JambaMambaDecoderLayer, JambaAttentionDecoderLayer") as info:
        find_layer_stack(jamba)
    assert "pass pipeline_layers='model.layers'" in str(info.value)
    assert find_layer_stack(jamba, "model.layers")[1] is jamba.model.layers


class Shared(nn.Module):
    """A norm the forward applies before and after the blocks (registered after them)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)


def test_a_module_called_on_both_sides_of_the_stack_is_tied_between_first_and_last_stage():
    from megastrategy.anatomy import ModelAnatomy

    module = Shared()
    by_registration = ModelAnatomy.of(module, "blocks")
    assert [o.name for o in by_registration.pre] == ["embed"] and not by_registration.tied_parameters
    called = {"embed": frozenset({"before"}), "norm": frozenset({"before", "after"}), "head": frozenset({"after"})}
    anatomy = ModelAnatomy.of(module, "blocks", called)
    assert [o.name for o in anatomy.pre] == ["embed", "norm"] and [o.name for o in anatomy.post] == ["norm", "head"]
    assert {id(p) for p in anatomy.tied_parameters} == {id(p) for p in module.norm.parameters()}


def test_blocks_in_a_sequential_are_the_stack_only_when_no_list_holds_blocks():
    """timm keeps a ViT's blocks in an nn.Sequential; an MLP's Sequential of bare layers is no stack."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    class ViTLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(Block(), Block(), Block())

    model = ViTLike()
    assert find_layer_stack(model) == ("blocks", model.blocks)
    model.layers = nn.ModuleList([Block(), Block()])
    assert find_layer_stack(model)[0] == "layers"


def test_a_multimodal_model_uses_the_plan_of_its_text_model_not_the_first_tower():
    """Voxtral declares no pp plan itself; its audio tower's layers came first and were cut into stages
    while a text-only batch never runs them (the step crashed in get_input_embeddings). The text model's
    own base_model_pp_plan names the stack."""
    from tests.helpers.tiny_configs import tiny_config

    model = transformers.VoxtralForConditionalGeneration(tiny_config("voxtral"))
    assert pp_plan_stack(model) == "model.language_model.layers"
    assert find_layer_stack(model)[0] == "model.language_model.layers"


def test_a_multimodal_models_stack_is_its_language_models_blocks():
    """Gemma 3's vision tower has as many layers as its text model here (more in PaliGemma): the
    stack is the one holding the token embeddings' blocks, which a text batch runs."""
    from tests.helpers.hf_zoo import tiny_model

    module = nn.Module()
    module.model = tiny_model("generic.gemma3")
    assert find_layer_stack(module)[0] == "model.model.language_model.layers"

