"""The parameters every pipeline stage holds a copy of: those registered directly on the module holding
the layer stack and on its ancestors, not those of their other submodules (pipeline/ancestor_parameters.py)."""
import torch
from torch import nn

from megastrategy.pipeline.ancestor_parameters import ancestor_parameters


def test_direct_parameters_of_the_root_and_of_the_stacks_ancestors():
    root = nn.Module()
    root.scale = nn.Parameter(torch.ones(()))
    root.model = nn.Module()
    root.model.bias = nn.Parameter(torch.zeros(2))
    root.model.layers = nn.ModuleList([nn.Linear(2, 2)])
    root.model.norm = nn.LayerNorm(2)
    root.head = nn.Linear(2, 2)
    root.alias = root.scale  # the same parameter registered twice is counted once
    assert ancestor_parameters(root, "model.layers") == [root.scale, root.model.bias]
    assert ancestor_parameters(root, "model") == [root.scale]
