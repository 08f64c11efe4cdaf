"""The typed configuration: every constructor rule raises before any work, naming its argument,
and the README's error table documents every rule the code has."""
import re
from pathlib import Path

import pytest

from megastrategy import MegatronStrategy
from megastrategy.config import CONSTRUCTOR_RULES, MegatronConfig
from megastrategy.errors import MegatronConfigError

README = Path(__file__).resolve().parents[1] / "README.md"


def _error_table_rows() -> list[str]:
    text = README.read_text()
    section = text[text.index("## Errors"):]
    return [line for line in section.splitlines() if line.startswith("| ")]


@pytest.mark.parametrize("rule", CONSTRUCTOR_RULES, ids=lambda r: f"{r.argument}:{r.bad_example}")
def test_every_rule_raises_naming_its_argument(rule):
    with pytest.raises(MegatronConfigError) as err:
        MegatronConfig(**rule.bad_example)
    assert rule.argument in str(err.value)
    with pytest.raises(MegatronConfigError):  # the same through the strategy, before any process
        MegatronStrategy(**rule.bad_example)


@pytest.mark.parametrize("rule", CONSTRUCTOR_RULES, ids=lambda r: f"{r.argument}:{r.bad_example}")
def test_every_rule_has_a_row_in_the_readme_error_table(rule):
    rows = _error_table_rows()
    assert any(row.startswith(f"| {rule.readme_situation} |") for row in rows), (rule, rows)


def test_the_config_is_frozen_and_normalised():
    config = MegatronConfig(tp=2, pp=2, tp_plan={"a": "column"})
    assert config.etp == 2 and config.num_microbatches == 2 and config.cuda_graph_scope == ()
    with pytest.raises(Exception):
        config.tp = 4


def test_an_unknown_keyword_is_refused_not_silently_ignored():
    with pytest.raises(MegatronConfigError, match=re.escape("sequence_paralel=True") + ".*unknown"):
        MegatronStrategy(tp=2, sequence_paralel=True)
    MegatronStrategy(tp=1, process_group_backend="gloo")  # Lightning's own arguments still pass
