"""Lightning habits, round 8 (tests/helpers/round8_habits.py): round 3's launcher, round 8's habits.

``--habits a,b,c`` runs each named habit on ``DDPStrategy`` or ``MegatronStrategy(tp, pp)``; rank 0
writes ``{habit: report}`` to ``--out`` and prints each report as it is made (round 7's ``_printed``).
Launched by tests/helpers/launch.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.round8_habits import HABITS  # noqa: E402
from tests.scripts.habits_round3 import main  # noqa: E402
from tests.scripts.habits_round7 import _printed  # noqa: E402

if __name__ == "__main__":
    main({name: _printed(name, habit) for name, habit in HABITS.items()})
