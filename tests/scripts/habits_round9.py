"""Round 9's Lightning habits (tests/helpers/round9_habits.py) on round 3's launcher, each report printed
by rank 0 as it is made (round 7's ``_printed``): ``--habits a,b,c`` on ``DDPStrategy`` or
``MegatronStrategy(tp, pp)``, rank 0 writing ``{habit: report}`` to ``--out``. Launched by tests/helpers/launch.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if __name__ == "__main__":
    from tests.helpers.round9_habits import HABITS
    from tests.scripts.habits_round3 import main
    from tests.scripts.habits_round7 import _printed

    main({name: _printed(name, habit) for name, habit in HABITS.items()})
