"""Every impossible configuration fails before any process group exists, naming the argument.

Rules that need only the world size fail when the Trainer is built (in the launching process,
before any worker starts). Rules that need the model fail in setup_environment, before
init_process_group: these tests pose as rank 0 of a 2- or 4-process job whose other ranks never
come, so a rule checked too late would block in the rendezvous (and fail by pytest-timeout).
"""
from datetime import timedelta

import lightning as L
import pytest
import torch.distributed as dist
from torch import nn

from megastrategy import MegatronConfigError, MegatronStrategy
from megastrategy.pipeline.stage import iter_microbatches
from tests.helpers.dist import free_port
from tests.helpers.models import GPT, BertClassifier

pytestmark = pytest.mark.timeout(60)


def _trainer(devices, **strategy_kwargs):
    # a rule checked too late blocks in the rendezvous, inside C++ where pytest-timeout's signal cannot
    # interrupt it: the store's own timeout ends it, failing the test instead of hanging the run
    strategy_kwargs.setdefault("timeout", timedelta(seconds=20))
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=MegatronStrategy(**strategy_kwargs),
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
    )


@pytest.fixture
def posing_as_rank0(monkeypatch):
    """Make Lightning believe it is rank 0 of an externally launched job."""

    def pose(world_size):
        for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
                         RANK="0", LOCAL_RANK="0", NODE_RANK="0").items():
            monkeypatch.setenv(k, v)

    yield pose
    assert not dist.is_initialized(), "a process group was created before the error"


@pytest.mark.parametrize(
    "devices, kwargs, match",
    [
        (3, dict(tp=2), r"world size 3 is not divisible by tp·pp·cp = 2·1·1 = 2.*divisors of 3: \[1, 3\]"),
        (4, dict(tp=2, pp=4), r"world size 4 is not divisible by tp·pp·cp"),
        (2, dict(vp=2), r"vp=2 needs pipeline parallelism"),
        (4, dict(ep=3), r"world size 4 is not divisible by etp·ep·pp = 1·3·1 = 3.*\[1, 2, 4\]"),
    ],
)
def test_layout_errors_come_when_the_trainer_is_built(devices, kwargs, match):
    with pytest.raises(MegatronConfigError, match=match):
        _trainer(devices, **kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, match", [(dict(tp=0), r"tp=0"), (dict(pp=-1), r"pp=-1"),
                                           (dict(num_microbatches=0), r"num_microbatches=0"),
                                           (dict(tp_plan=["q"]), r"tp_plan=\['q'\]"),
                                           (dict(ep=2, cp=2), r"ep=2, cp=2.*cannot be combined"),
                                           (dict(backend="apex"), r"backend='apex'.*'auto', 'torch', 'te'"),
                                           (dict(fp8=True, backend="torch"), r"fp8=True.*backend"),
                                           (dict(cuda_graph_scope=["mlp"]), r"cuda_graph_scope.*'mlp'.*attn"),
                                           (dict(cuda_graph_scope=["attn"], activation_checkpointing="full"),
                                            r"cuda_graph_scope.*activation_checkpointing")])
def test_bad_arguments_fail_in_the_constructor(kwargs, match):
    with pytest.raises(MegatronConfigError, match=match):
        MegatronStrategy(**kwargs)


class _ThreeLayerGPT(GPT):
    def __init__(self):
        super().__init__(n_layer=3)


def _boring():
    from lightning.pytorch.demos.boring_classes import BoringModel

    return BoringModel()


class _NotAList(GPT):
    def __init__(self):
        super().__init__()
        self.stack = nn.Linear(2, 2)  # neither an nn.ModuleList nor an nn.Sequential of blocks


@pytest.mark.parametrize(
    "devices, make_module, kwargs, match",
    [
        (4, lambda: _ThreeLayerGPT(), dict(pp=4), r"num_layers=3 cannot fill pp_size=4"),
        (2, lambda: GPT(n_layer=4), dict(pp=2, pipeline_layers="stack"), r"pipeline_layers='stack'"),
        (2, lambda: _NotAList(), dict(pp=2, pipeline_layers="stack"), r"pipeline_layers='stack' is a Linear, not an nn.ModuleList or nn.Sequential"),
        (4, lambda: GPT(n_layer=8), dict(pp=4, vp=2, num_microbatches=7), r"num_microbatches"),
        (2, lambda: GPT(), dict(tp=2, tp_plan={"blocks.*.qq": "column"}), r"blocks\.\*\.qq"),
        (2, lambda: GPT(), dict(tp=2, tp_plan={"blocks.*.q": "diagonal"}), r"diagonal"),
        (2, lambda: GPT(), dict(tp=2, tp_plan={"wpe": "row"}), r"wpe"),
        (2, lambda: _boring(), dict(tp=2), r"tp_plan"),  # no layer stack, nothing known: a plan is needed
    ],
    ids=["layers-vs-pp", "pipeline-layers-missing", "pipeline-layers-not-list", "interleaved-microbatches",
         "glob-matches-nothing", "unknown-style", "style-does-not-fit", "undetectable-model"],
)
def test_model_errors_come_before_any_collective(posing_as_rank0, devices, make_module, kwargs, match):
    posing_as_rank0(devices)
    trainer = _trainer(devices, **kwargs)
    with pytest.raises(MegatronConfigError, match=match):
        trainer.fit(make_module())


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(backend="te"), r"backend='te'.*(CUDA|transformer_engine|Transformer Engine)"),
     (dict(fp8=True), r"fp8=True needs the Transformer Engine backend, which backend='auto' cannot use here.*cpu"),
     (dict(cuda_graph_scope=["attn"]), r"cuda_graph_scope.*(CUDA|GPU)")],
    ids=["te-without-gpu", "fp8-without-te", "cuda-graphs-without-gpu"],
)
def test_gpu_only_features_on_a_cpu_fail_before_any_collective(posing_as_rank0, kwargs, match):
    posing_as_rank0(2)
    trainer = _trainer(2, **kwargs)
    with pytest.raises(MegatronConfigError, match=match):
        trainer.fit(GPT())


def test_heads_not_divisible_by_tp_names_the_module_and_valid_tp(posing_as_rank0):
    posing_as_rank0(4)

    class SixHeads(GPT):
        def __init__(self):
            super().__init__(d=36, n_head=6)

    trainer = _trainer(4, tp=4, tp_plan=GPT.TP_PLAN)
    with pytest.raises(MegatronConfigError, match=r"tp=4.*(n_head|heads).*6"):
        trainer.fit(SixHeads())


def test_ffn_size_not_divisible_by_tp_names_the_layer(posing_as_rank0):
    posing_as_rank0(4)

    class OddFFN(GPT):
        def __init__(self):
            super().__init__()
            for block in self.blocks:
                block.fc, block.out = nn.Linear(32, 130), nn.Linear(130, 32)

    trainer = _trainer(4, tp=4, tp_plan=GPT.TP_PLAN)
    with pytest.raises(MegatronConfigError, match=r"tp=4 does not divide out_features=130 of blocks\.0\.fc.*use tp in \{1, 2\}"):
        trainer.fit(OddFFN())


def test_hf_bert_heads_not_divisible_by_tp(posing_as_rank0):
    posing_as_rank0(4)
    from transformers import BertConfig, BertForSequenceClassification

    class Bert6(BertClassifier):
        def __init__(self):
            super().__init__()
            self.model = BertForSequenceClassification(BertConfig(
                vocab_size=50, hidden_size=36, num_hidden_layers=1, num_attention_heads=6, intermediate_size=72))

    trainer = _trainer(4, tp=4)
    with pytest.raises(MegatronConfigError, match=r"tp=4.*num_attention_heads=6"):
        trainer.fit(Bert6())


def test_batch_not_divisible_by_microbatches_names_the_batch_size():
    import torch

    with pytest.raises(MegatronConfigError, match=r"num_microbatches=4 does not divide the batch size 6.*\[1, 2, 3, 6\]"):
        list(iter_microbatches({"x": torch.zeros(6, 2)}, 4))
