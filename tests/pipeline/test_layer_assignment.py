import itertools

import pytest

from megastrategy.errors import MegatronConfigError
from megastrategy.pipeline import assign_layers


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


def test_uneven_split_names_rule_and_alternatives():
    with pytest.raises(MegatronConfigError) as info:
        assign_layers(10, 4)
    msg = str(info.value)
    assert "num_layers=10" in msg and "pp_size=4" in msg and "vp_size=1" in msg
    assert "num_layers % (pp_size * vp_size) == 0" in msg
    assert "{8, 12}" in msg  # nearest layer counts
    assert "pp_size in {1, 2, 5, 10}" in msg


def test_uneven_split_suggests_vp_values():
    with pytest.raises(MegatronConfigError) as info:
        assign_layers(16, 4, 3)
    msg = str(info.value)
    assert "{12, 24}" in msg and "vp_size in {1, 2, 4}" in msg


def test_error_is_a_value_error():
    with pytest.raises(ValueError):
        assign_layers(7, 2)


@pytest.mark.parametrize(
    "args,name",
    [((0, 1), "num_layers"), ((4, 0), "pp_size"), ((4, 2, 0), "vp_size"), ((4, -2), "pp_size"),
     ((4.0, 2), "num_layers"), ((True, 1), "num_layers"), ((4, "2"), "pp_size")],
)
def test_non_positive_or_non_int_rejected(args, name):
    with pytest.raises(MegatronConfigError, match=name):
        assign_layers(*args)
