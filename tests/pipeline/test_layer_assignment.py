import itertools

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline import assign_layers
from megastrategy.pipeline.layer_assignment import stage_layer_counts


def test_non_interleaved_blocks():
    assert assign_layers(8, 4) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]


def test_interleaved_chunks_go_round_the_ranks():
    assert assign_layers(16, 4, 2) == [
        [[0, 1], [8, 9]],
        [[2, 3], [10, 11]],
        [[4, 5], [12, 13]],
        [[6, 7], [14, 15]],
    ]


def test_single_rank_single_chunk_holds_everything():
    assert assign_layers(5, 1) == [[[0, 1, 2, 3, 4]]]


@pytest.mark.parametrize("pp,vp,per_chunk", list(itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3])))
def test_virtual_stages_in_order_cover_every_layer_once(pp, vp, per_chunk):
    num_layers = pp * vp * per_chunk
    table = assign_layers(num_layers, pp, vp)
    assert len(table) == pp and all(len(chunks) == vp for chunks in table)
    # virtual stage s = chunk * pp + rank; walking stages in order must walk layers in order
    walked = []
    for stage in range(pp * vp):
        layers = table[stage % pp][stage // pp]
        assert len(layers) == per_chunk
        walked.extend(layers)
    assert walked == list(range(num_layers))


def test_uneven_split_gives_the_earliest_stages_the_remainder():
    assert assign_layers(10, 4) == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7]], [[8, 9]]]
    assert stage_layer_counts(12, 5) == [3, 3, 2, 2, 2]


@pytest.mark.parametrize("num_layers,pp,vp", [(7, 2, 1), (10, 4, 1), (16, 4, 3), (13, 3, 2), (5, 4, 1)])
def test_any_split_walks_every_layer_once_in_stage_order(num_layers, pp, vp):
    table = assign_layers(num_layers, pp, vp)
    walked = [layer for stage in range(pp * vp) for layer in table[stage % pp][stage // pp]]
    assert walked == list(range(num_layers))
    sizes = [len(chunk) for chunks in table for chunk in chunks]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_named_counts_are_taken_as_given_on_the_ring_of_chunks():
    assert assign_layers(6, 2, 1, stage_layers=(4, 2)) == [[[0, 1, 2, 3]], [[4, 5]]]
    assert assign_layers(6, 2, 2, stage_layers=(1, 2, 2, 1)) == [[[0], [3, 4]], [[1, 2], [5]]]


def test_named_counts_that_do_not_fit_the_model_name_the_rule_and_a_split_that_works():
    with pytest.raises(MegatronConfigError) as info:
        assign_layers(10, 4, stage_layers=(3, 3, 3, 3))
    msg = str(info.value)
    assert "pipeline_stage_layers=(3, 3, 3, 3)" in msg and "num_layers=10" in msg
    assert "(3, 3, 2, 2)" in msg


def test_fewer_layers_than_stages_names_the_rule_and_what_fits():
    with pytest.raises(MegatronConfigError) as info:
        assign_layers(3, 4)
    msg = str(info.value)
    assert "num_layers=3" in msg and "num_layers >= pp_size * vp_size" in msg and "pp_size <= 3" in msg
    with pytest.raises(ValueError, match="vp_size <= 2"):
        assign_layers(5, 2, 3)


@pytest.mark.parametrize(
    "args,name",
    [((0, 1), "num_layers"), ((4, 0), "pp_size"), ((4, 2, 0), "vp_size"), ((4, -2), "pp_size"),
     ((4.0, 2), "num_layers"), ((True, 1), "num_layers"), ((4, "2"), "pp_size")],
)
def test_non_positive_or_non_int_rejected(args, name):
    with pytest.raises(MegatronConfigError, match=name):
        assign_layers(*args)
