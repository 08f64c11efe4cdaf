"""Lightning habits, round 3: several habits one after another in one launch, each on a fresh Trainer.

``--habits a,b,c`` runs each named habit (see ``HABITS``) with a tiny hand-written GPT
(tests/helpers/models.py, hidden 32, 2 layers) on ``DDPStrategy`` or ``MegatronStrategy(tp, pp)``;
rank 0 writes ``{habit: report}`` to ``--out`` (a report: per-step losses and what else the habit
checks; a habit that raised reports its error). Launched by tests/helpers/launch.py.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from tests.helpers.round3_habits import HABITS  # noqa: E402
from tests.helpers.script_args import layout_parser, leave_without_static_destructors  # noqa: E402


def main(habits: dict = HABITS) -> None:
    """Run ``--habits`` from ``habits`` (round 3's by default; tests/scripts/habits_round4.py passes its own)."""
    p = layout_parser()
    p.add_argument("--habits", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--dp", type=int, default=1, help="the data-parallel size the habit expects")
    args = p.parse_args()
    args.devices = int(os.environ["WORLD_SIZE"])  # Lightning's teardown removes it
    torch.set_num_threads(1)
    reports = {}
    for name in args.habits.split(","):
        L.seed_everything(7, verbose=False)
        try:
            reports[name] = habits[name](args, Path(args.dir) / name)
        except Exception as error:  # noqa: BLE001 - the test reads the message
            reports[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
            print(reports[name]["trace"], flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(reports))
    leave_without_static_destructors()


if __name__ == "__main__":
    main()
