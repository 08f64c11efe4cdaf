"""Dotted fix-ups (``layers/plan/dotted_attrs.py``): a module's head count in a shared config
changes on that module's own copy only."""
from types import SimpleNamespace

from torch import nn

from megastrategy.layers.plan.dotted_attrs import get_dotted, set_dotted_on_own_copy


def test_a_shared_config_is_copied_once_per_module_and_the_original_kept():
    shared = SimpleNamespace(n_head=4, n_query_groups=4, head_size=8)
    a, b = nn.Module(), nn.Module()
    a.config = b.config = shared
    copied: set[int] = set()
    set_dotted_on_own_copy(a, "config.n_head", 2, copied)
    set_dotted_on_own_copy(a, "config.n_query_groups", 2, copied)
    assert (a.config.n_head, a.config.n_query_groups, a.config.head_size) == (2, 2, 8)
    assert b.config is shared and (shared.n_head, shared.n_query_groups) == (4, 4)
    assert get_dotted(a, "config.n_head") == 2 and get_dotted(a, "config.missing") is None
