"""``Trainer(sync_batchnorm=True)`` under MegatronStrategy: BatchNorm layers become SyncBatchNorm over
the data-parallel (times cp) group, keeping their Parameter objects; refused on CPU as DDP refuses it.
The launched check (tp2 and dp2 against DDP) is tests/test_user_habits_round5.py's."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megastrategy.config import MegatronConfig
from megastrategy.ddp.sync_batchnorm import SyncBatchNormLayers
from megastrategy.errors import MegatronConfigError

GROUP = object()  # stands in for the dp-cp process group: conversion only stores it


def _ctx(device: str):
    return SimpleNamespace(device=torch.device(device), parallel_state=SimpleNamespace(dp_cp_group=GROUP))


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))


def test_converted_over_the_data_parallel_group_keeping_the_parameters():
    model = _model()
    weight = model[1].weight
    SyncBatchNormLayers(MegatronConfig(), lambda: True).on_fit_setup(model, _ctx("cuda"))
    assert isinstance(model[1], nn.SyncBatchNorm) and model[1].process_group is GROUP
    assert model[1].weight is weight  # the gradient buffers and the optimizer see the same tensors


def test_left_alone_when_not_requested_or_without_batchnorm():
    model = _model()
    SyncBatchNormLayers(MegatronConfig(), lambda: False).on_fit_setup(model, _ctx("cpu"))
    assert type(model[1]) is nn.BatchNorm1d
    SyncBatchNormLayers(MegatronConfig(), lambda: True).on_fit_setup(nn.Linear(2, 2), _ctx("cpu"))


def test_refused_on_cpu_naming_the_flag_and_the_layer():
    with pytest.raises(MegatronConfigError, match=r"sync_batchnorm=True.*'cpu'.*'1'.*sync_batchnorm=False"):
        SyncBatchNormLayers(MegatronConfig(), lambda: True).on_fit_setup(_model(), _ctx("cpu"))
