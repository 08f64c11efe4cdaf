"""Rank-group layouts, pinned to Megatron's worked examples; no processes needed except the last test."""
import pytest
import torch.distributed as dist

from megastrategy.errors import MegatronConfigError
from megastrategy.parallel_state import ParallelLayout, ParallelState, RankGenerator
from tests.helpers.dist import run_distributed


def test_tp4_pp2_dp2_on_16_ranks():
    gen = RankGenerator(tp=4, ep=1, dp=2, pp=2, cp=1)
    assert gen.get_ranks("tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert gen.get_ranks("pp") == [[i, i + 8] for i in range(8)]
    assert gen.get_ranks("tp-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert gen.get_ranks("tp-dp") == [list(range(8)), list(range(8, 16))]
    assert gen.get_ranks("dp-cp") == gen.get_ranks("dp")  # cp=1 adds nothing


def test_moe_etp1_pp2_ep4_edp2_on_16_ranks():
    gen = RankGenerator(tp=1, ep=4, dp=2, pp=2, cp=1)
    assert gen.get_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert gen.get_ranks("pp") == [[i, i + 8] for i in range(8)]
    assert gen.get_ranks("tp") == [[r] for r in range(16)]
    assert gen.get_ranks("tp-ep-pp") == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_moe_folding_world8_tp2_etp1_ep4():
    layout = ParallelLayout(world_size=8, tp=2, etp=1, ep=4)
    assert (layout.dp, layout.edp) == (4, 2)
    dense, expert = layout.dense_generator(), layout.expert_generator()
    assert dense.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dense.get_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert expert.get_ranks("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert expert.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_every_group_family_partitions_the_world():
    gen = RankGenerator(tp=2, ep=1, dp=3, pp=2, cp=2)
    for token in ("tp", "cp", "dp", "pp", "tp-pp", "dp-cp", "tp-cp-dp-pp"):
        groups = gen.get_ranks(token)
        assert sorted(r for g in groups for r in g) == list(range(24)), token


def test_global_rank_has_first_order_dim_fastest():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.coordinates(5) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    other = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    assert other.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_a_dimension_missing_from_order_is_an_error():
    with pytest.raises(MegatronConfigError, match="order='tp-dp-pp' leaves out \\['cp'\\]"):
        RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=2, order="tp-dp-pp")


def test_ep_with_cp_in_one_generator_is_an_error():
    with pytest.raises(MegatronConfigError, match="ep=2 with cp=2"):
        RankGenerator(tp=1, ep=2, dp=1, pp=1, cp=2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=3, tp=2), "world size 3 is not divisible by tp·pp·cp"),
        (dict(world_size=8, ep=3), "not divisible by etp·ep·pp"),
        (dict(world_size=4, vp=2), "vp=2 needs pipeline parallelism"),
        (dict(world_size=4, tp=0), "tp=0 must be a positive integer"),
    ],
)
def test_layout_errors_name_the_argument(kwargs, match):
    with pytest.raises(MegatronConfigError, match=match):
        ParallelLayout(**kwargs)


def _groups_of_every_rank(rank, world_size):
    state = ParallelState(ParallelLayout(world_size=world_size, tp=2, pp=2), rank)
    t = __import__("torch").ones(1)
    dist.all_reduce(t, group=state.tp_group)
    return {
        "tp": state.tp_ranks,
        "pp": state.pp_ranks,
        "dp": state.dp_ranks,
        "emb": state.embedding_ranks,
        "tp_sum": t.item(),
        "first": state.is_first_stage,
        "last": state.is_last_stage,
        "next": state.next_stage_rank,
    }


def test_parallel_state_creates_working_groups_on_8_processes():
    out = run_distributed(_groups_of_every_rank, 8, timeout=180)
    assert out[0]["tp"] == [0, 1] and out[0]["pp"] == [0, 4] and out[0]["dp"] == [0, 2]
    assert out[5]["emb"] == [1, 5] and out[5]["last"] and not out[5]["first"]
    assert out[1]["next"] == 5
    assert all(o["tp_sum"] == 2.0 for o in out)
