"""Lightning habits, round 7 (tests/helpers/round7_habits.py): round 3's launcher, round 7's habits.

``--habits a,b,c`` runs each named habit on ``DDPStrategy`` or ``MegatronStrategy(tp, pp)``; rank 0
writes ``{habit: report}`` to ``--out``, and prints each report as it is made (a habit that hangs
is then found by the ones printed before it). Launched by tests/helpers/launch.py.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.round7_habits import HABITS  # noqa: E402
from tests.scripts.habits_round3 import main  # noqa: E402


def _printed(name, habit):
    def run(args, workdir):
        report = habit(args, workdir)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"habit {name}: {json.dumps(report)[:2000]}", flush=True)
        return report

    return run


if __name__ == "__main__":
    main({name: _printed(name, habit) for name, habit in HABITS.items()})
