"""Lightning habits, round 6 (tests/helpers/round6_habits.py): round 3's launcher, round 6's habits.

``--habits a,b,c`` runs each named habit on ``DDPStrategy`` or ``MegatronStrategy(tp, pp)``; rank 0
writes ``{habit: report}`` to ``--out``. Launched by tests/helpers/launch.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.round6_habits import HABITS  # noqa: E402
from tests.scripts.habits_round3 import main  # noqa: E402

if __name__ == "__main__":
    main(HABITS)
