"""Callbacks that cannot do on a split model what they do on one device are refused by name."""
import pytest
from lightning.pytorch.callbacks import ModelPruning, OnExceptionCheckpoint

from megastrategy.callback_guard import refuse_callbacks
from megastrategy.errors import MegatronConfigError


def test_model_pruning_is_refused_where_it_ranks_part_of_a_weight_or_model(tmp_path):
    with pytest.raises(MegatronConfigError, match="ModelPruning with tp=2, pp=1"):
        refuse_callbacks([ModelPruning("l1_unstructured")], tp=2, pp=1)
    with pytest.raises(MegatronConfigError, match="use_global_unstructured=False"):
        refuse_callbacks([ModelPruning("l1_unstructured")], tp=1, pp=2)
    refuse_callbacks([ModelPruning("l1_unstructured", use_global_unstructured=False)], tp=1, pp=2)  # whole tensors
    refuse_callbacks([ModelPruning("l1_unstructured")], tp=1, pp=1)


def test_on_exception_checkpoint_is_refused_under_pipeline_parallelism(tmp_path):
    with pytest.raises(MegatronConfigError, match="OnExceptionCheckpoint with pp=2.*hang"):
        refuse_callbacks([OnExceptionCheckpoint(str(tmp_path))], tp=1, pp=2)
    refuse_callbacks([OnExceptionCheckpoint(str(tmp_path))], tp=2, pp=1)
