"""The tensor-parallel component refuses a ``torch.compile``'d model before any work: dynamo
cannot trace the sharded layers (it failed at the first step with a size-guard error)."""
import pytest
import torch
import transformers

from megastrategy.config import MegatronConfig
from megastrategy.errors import MegatronConfigError
from megastrategy.layers.components.tensor_parallel import TensorParallel
from tests.helpers.causal_lm_steps import tiny_llama_config


def _holder(compiled: bool) -> torch.nn.Module:
    holder = torch.nn.Module()
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config())
    holder.model = torch.compile(model, backend="eager") if compiled else model
    return holder


def test_a_compiled_model_is_refused_at_tp2_naming_it():
    with pytest.raises(MegatronConfigError, match=r"tp=2 with the torch.compile'd module 'model'.*pp and dp"):
        TensorParallel(MegatronConfig(tp=2)).validate(_holder(compiled=True), None)


def test_the_same_model_uncompiled_resolves_its_plan():
    component = TensorParallel(MegatronConfig(tp=2))
    component.validate(_holder(compiled=False), None)
    assert component.plan is not None and component.plan.tp_size == 2


def test_a_declared_plan_that_cannot_be_resolved_refuses_tp2_but_not_tp1():
    """Zaya's declared plan shards half of its router MLP: refused where it would shard (tp=2), an
    empty plan where nothing is sharded (tp=1: data, expert or pipeline parallelism alone)."""
    from tests.helpers.hf_zoo import tiny_model

    model = tiny_model("generic.zaya")
    with pytest.raises(MegatronConfigError, match="must be sharded together"):
        TensorParallel(MegatronConfig(tp=2)).validate(model, None)
    component = TensorParallel(MegatronConfig())
    component.validate(model, None)
    assert component.plan.tp_size == 1 and not component.plan.entries


def _tied_bert_generation() -> torch.nn.Module:
    """BertGeneration's head is tied to its embedding, which auto-detection refuses for tp > 1."""
    from tests.helpers.hf_zoo import GENERIC, tiny_model

    holder = torch.nn.Module()
    holder.model = tiny_model(GENERIC + "bert-generation")
    return holder


def test_at_tp1_a_plan_auto_detection_refuses_is_empty_instead():
    with pytest.raises(MegatronConfigError, match="is tied to"):
        TensorParallel(MegatronConfig(tp=2)).validate(_tied_bert_generation(), None)
    component = TensorParallel(MegatronConfig(tp=1, pp=2))  # pp2/cp2 runs shard nothing: not refused
    component.validate(_tied_bert_generation(), None)
    assert component.plan.tp_size == 1 and component.plan.entries == ()
