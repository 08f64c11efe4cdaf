"""Draw the 1F1B, interleaved 1F1B, ZB-H1 and ZB-V timelines used in the docs (pp=4, m=8).

Run from the repository root:  python bench/draw_schedules.py [output_dir]
Chunk times are the stage times divided by vp (ZB-V: two chunks per rank), and the zero-bubble
schedules' B and W are each half a backward, so all pictures show the same model.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megastrategy.pipeline import draw_timeline, simulate_schedule

PP, M, FORWARD, BACKWARD = 4, 8, 1.0, 2.0


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for vp, name, label in ((1, "schedule_1f1b.png", "1F1B"), (2, "schedule_interleaved.png", "interleaved 1F1B")):
        stats = simulate_schedule(M, PP, vp, forward_time=FORWARD / vp, backward_time=BACKWARD / vp)
        draw_timeline(stats, out_dir / name, f"{label}: pp={PP}, vp={vp}, m={M}, backward = 2 x forward")
        print(f"{name}: makespan {stats.makespan:g}, bubble {stats.bubble_fraction:.4f}, "
              f"peak in-flight per rank {stats.peak_in_flight}")
    stats = simulate_schedule(M, PP, forward_time=FORWARD, backward_time=BACKWARD, schedule="zb_h1")
    draw_timeline(stats, out_dir / "schedule_zb_h1.png", f"ZB-H1: pp={PP}, m={M}, F = B = W")
    print(f"schedule_zb_h1.png: makespan {stats.makespan:g}, bubble {stats.bubble_fraction:.4f}, "
          f"idle per rank {stats.idle}, peak in-flight per rank {stats.peak_in_flight}")
    stats = simulate_schedule(M, PP, forward_time=FORWARD / 2, backward_time=BACKWARD / 2, schedule="zb_v")
    draw_timeline(stats, out_dir / "schedule_zb_v.png",
                  f"ZB-V: pp={PP}, m={M}, two chunks per rank in a V (chunk 1 = way back up), F = B = W")
    print(f"schedule_zb_v.png: makespan {stats.makespan:g}, bubble {stats.bubble_fraction:.4f}, "
          f"idle per rank {stats.idle}, peak in-flight chunk-microbatches per rank {stats.peak_in_flight}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "docs" / "img")
