"""A LitGPT model under pp=2: its ``lm_head`` is registered before ``transformer``, so only the dry
run of its forward (``pipeline/forward_order.py``) puts the head on the last stage."""
import pytest

from megastrategy.pipeline.forward_order import record_forward_order
from tests.helpers.litgpt_runs import assert_litgpt_matches_ddp, tiny_litgpt


def test_the_head_registered_before_the_stack_is_found_to_run_after_it():
    order = record_forward_order(tiny_litgpt(groups=2), "transformer.h")
    assert order is not None and order.stack_calls == (0, 1, 2, 3)
    assert order.called["lm_head"] == {"after"} and order.called["transformer.ln_f"] == {"after"}
    assert order.called["transformer.wte"] == {"before"}


@pytest.mark.timeout(500)
def test_litgpt_trains_like_one_device_pp2():
    assert_litgpt_matches_ddp("--pp", "2")
