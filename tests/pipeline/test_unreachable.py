"""The stand-in for a module a stage does not own (registered after the stack, on a stage before the last)."""
import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline.stage import Unreachable, UnreachableAttributeError


def test_reading_indexing_or_calling_it_is_refused_by_name():
    heads = Unreachable("model.heads")
    with pytest.raises(UnreachableAttributeError, match=r"model\.heads\.weight was read on a pipeline stage that does not own model\.heads.*In a hook"):
        heads.weight
    for use in (lambda: heads[0], lambda: list(heads), lambda: len(heads)):  # MarkupLM's, PoolFormer's lists
        with pytest.raises(UnreachableAttributeError, match=r"model\.heads\[\.\.\.\] was read on a pipeline stage"):
            use()
    with pytest.raises(MegatronConfigError, match="model.heads"):
        heads()


def test_it_is_still_a_module_to_truth_tests_and_attribute_probes():
    pooler = Unreachable("model.pooler")
    assert pooler  # `if self.pooler:` must not ask __len__
    assert not hasattr(pooler, "dense")  # an AttributeError too: probes answer no
