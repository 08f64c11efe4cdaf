import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline import ScheduleStep, schedule_steps, training_steps, validate_pipeline_schedule, zb_h1_steps
from megastrategy.pipeline.zero_bubble_v import zb_v_steps


def test_names_pick_their_orders():
    assert training_steps("1f1b", 8, 4, 1, 2) == schedule_steps(8, 4, 1, 2)
    assert training_steps("zb_h1", 8, 4, 1) == zb_h1_steps(8, 4, 1)
    assert training_steps("zb_v", 8, 4, 1, 2) == zb_v_steps(8, 4, 1)


def test_unknown_name_lists_the_choices():
    with pytest.raises(MegatronConfigError, match=r"pipeline_schedule='gpipe'.*'1f1b'.*'zb_h1'.*'zb_v'"):
        validate_pipeline_schedule("gpipe", 2, 1)


@pytest.mark.parametrize("pp,vp", [(1, 1), (2, 2)])
def test_zb_h1_needs_one_chunk_and_a_pipeline(pp, vp):
    with pytest.raises(MegatronConfigError, match=r"pipeline_schedule='zb_h1'.*pp >= 2 and vp=None"):
        validate_pipeline_schedule("zb_h1", pp, vp)
    with pytest.raises(MegatronConfigError, match="vp_size=2"):
        training_steps("zb_h1", 4, 2, 0, 2)


def test_w_step_has_no_megatron_code():
    from megastrategy.pipeline import StepPart

    assert ScheduleStep(False, 1, 3, StepPart.INPUT).code == -2
    with pytest.raises(ValueError, match="weight-gradient"):
        ScheduleStep(False, 1, 3, StepPart.WEIGHT).code


def test_microbatches_for_a_ragged_batch_is_the_largest_divisor_the_schedule_runs():
    from megastrategy.pipeline.schedule_choice import microbatches_for

    assert microbatches_for(8, 4, "1f1b", 2, 0) == 4
    assert microbatches_for(6, 4, "1f1b", 2, 0) == 3
    assert microbatches_for(7, 4, "1f1b", 2, 1) == 1
    assert microbatches_for(6, 4, "zb_v", 2, 0, 2) == 3  # ZB-V needs at least 2*pp - 1 = 3
    with pytest.raises(MegatronConfigError, match=r"batch of 5 examples .*'zb_v'.*drop_last=True"):
        microbatches_for(5, 4, "zb_v", 2, 0, 2)
