"""Sweep EVERY causal LM transformers ships at tp=2 and pp=2 against one device (an offline probe,
not a CI test: a full sweep takes most of an hour on two cores).

Why: users try architectures the matrix (tests/layers/test_hf_matrix.py) never ran. Each must
either match one device (per-step losses within 2e-4) or be refused in setup with a clear
``MegatronConfigError``; a crash, a hang or a silent mismatch is a bug. Steps:

1. every ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` entry gets :func:`generic_tiny_config`; those whose
   config or one-process forward+backward fails (not our bug; multimodal models that need pixels)
   are skipped and counted;
2. the rest run through tests/scripts/hf_matrix.py (many models per launch): a DDP reference on one
   process, then ``--tp 2`` and ``--pp 2`` on two, every launch under a timeout; a model that hangs
   is recorded and the launch resumes after it;
3. the classified table (match / refused / crash / MISMATCH / hang) goes to ``--table``.

    python tests/scripts/hf_sweep.py --work /tmp/sweep --table docs/sweeps/causal_lm_tp_pp.md [--only a,b]
    python tests/scripts/hf_sweep.py --work /tmp/sweep --table docs/sweeps/causal_lm_cp2.md --layouts cp2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.helpers.hf_zoo import GENERIC  # noqa: E402

MATRIX = Path(__file__).resolve().parent / "hf_matrix.py"
REPO = MATRIX.parents[2]
LAYOUTS = {"tp2": ("megatron", 2, ["--tp", "2"]), "pp2": ("megatron", 2, ["--pp", "2"]),
           "cp2": ("megatron", 2, ["--cp", "2"]),  # cp2: hf_matrix's 12 tokens split into 2*cp = 4 chunks
           "tp2cp2": ("megatron", 4, ["--tp", "2", "--cp", "2"]),
           "tp2pp2": ("megatron", 4, ["--tp", "2", "--pp", "2"])}
TOL = 2e-4


def _alarm(signum, frame):
    raise TimeoutError("one-process forward took over 60 s")


def probe(model_type: str) -> str | None:
    """None when the tiny model trains one step on one process, else why not (the model is skipped)."""
    import torch
    import transformers

    from tests.helpers.hf_zoo import tiny_model

    transformers.logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        model = tiny_model(GENERIC + model_type)
        ids = torch.randint(3, 128, (4, 12), generator=torch.Generator().manual_seed(0))
        loss = model(input_ids=ids, labels=ids).loss
        if loss is None or not torch.isfinite(loss):
            return f"loss is {loss}"
        loss.backward()
        return None
    except Exception as e:  # noqa: BLE001 - a probe: any failure is a reason to skip
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    finally:
        signal.alarm(0)


def launch(models: list[str], strategy: str, nprocs: int, extra: list[str], timeout: float) -> tuple[dict, str]:
    """Run hf_matrix.py --keep-going on ``models``; returns what rank 0 wrote (possibly partial: a
    hang) and the ranks' log tails when the launch did not end cleanly."""
    from tests.helpers.dist import free_port
    from tests.helpers.warm_start import ScriptProcess

    out = Path(tempfile.mkdtemp(prefix="hf-sweep-")) / "result.json"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs),
               NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    args = ["--out", str(out), "--strategy", strategy, "--keep-going", "--models", ",".join(models), *extra]
    logs = [out.parent / f"rank{r}.log" for r in range(nprocs)]
    procs = []
    for r, log in enumerate(logs):
        log.touch()
        procs.append(ScriptProcess(str(MATRIX), args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=str(REPO),
                                   log_path=str(log)))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(2)  # let the peer notice; then kill it
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    clean = all(p.returncode == 0 for p in procs)
    tails = "" if clean else "\n".join(_why_stopped(r, log.read_text()) for r, log in enumerate(logs))
    return (json.loads(out.read_text()) if out.exists() else {}), tails


def _why_stopped(rank: int, log: str) -> str:
    """What stopped a rank: the watchdog's line naming the failing rank's error, else the log's tail."""
    said = log.rfind("failed while training step")
    return f"[rank {rank}] " + (log[said:].split("\n")[0] if said >= 0 else log[-1500:])


def run_layout(models: list[str], strategy: str, nprocs: int, extra: list[str], batch: int) -> dict:
    """Every model through launches of ``batch``. A model that fails at its first step on one rank
    stops its peers (the watchdog), which ends the launch: the first model left unrecorded is then
    run alone, and what stopped that launch is its result (``hang`` when nothing says)."""
    results, todo = {}, list(models)
    while todo:
        chunk = todo[:batch]
        got, tails = launch(chunk, strategy, nprocs, extra, timeout=60 + 25 * len(chunk))
        results.update(got)
        todo = todo[len([m for m in chunk if m in got]):]
        if tails and todo and len(chunk) > 1:
            alone, tails = launch(todo[:1], strategy, nprocs, extra, timeout=120)
            got.update(alone)
        if tails and todo:
            results[todo[0]] = got.get(todo[0]) or {"hang": tails[-3000:]}
            todo = todo[1:]
        print(f"  {strategy} {' '.join(extra)}: {len(results)}/{len(models)}", flush=True)
    return results


def classify(got: dict, ref: dict) -> tuple[str, str]:
    """(class, detail) of one model under a layout, against the one-device reference."""
    if "error" in got:  # a refusal after a training batch started came at run time, not in setup
        kind = "refused at step 0" if got.get("batches_started") else "refused"
        return kind, got["error"].splitlines()[0][:300]
    if "failed while training step 0: MegatronConfigError:" in got.get("hang", ""):
        return "refused at step 0", got["hang"].split("MegatronConfigError:")[1].strip().splitlines()[0][:300]
    if "failed while training step" in got.get("hang", ""):
        return "crash at step 0", got["hang"].split("failed while training step 0:")[-1].strip().splitlines()[0][:300]
    if "crash" in got or "hang" in got:
        kind = "crash" if "crash" in got else "hang"
        return kind, got[kind].replace("\n", " ")[-300:]
    pairs = list(zip(got["loss"] + [got["val_loss"]], ref["loss"] + [ref["val_loss"]]))
    worst = max((abs(a - b) if math.isfinite(a - b) else math.inf for a, b in pairs), default=math.inf)
    if len(got["loss"]) != len(ref["loss"]) or not worst <= TOL:
        return "MISMATCH", f"max diff {worst:.3g}"
    return "match", f"max diff {worst:.1e}; plan {','.join(sorted({s.split(':')[0] for s in got['sources']})) or '-'}"


def write_table(path: Path, skipped: dict, ref: dict, layouts: dict) -> None:
    rows, counts = [], {name: {} for name in layouts}
    for item in sorted(ref):
        if "loss" not in ref[item]:
            skipped[item.split(":")[0][len(GENERIC):]] = "reference run: " + str(next(iter(ref[item].values())))[:200]
            continue
        cells = []
        for name, got in layouts.items():
            kind, detail = classify(got.get(item, {"hang": "not run"}), ref[item])
            counts[name][kind] = counts[name].get(kind, 0) + 1
            cells.append(f"**{kind}** {detail}".replace("|", "/"))
        rows.append(f"| {item.split(':')[0][len(GENERIC):]} | " + " | ".join(cells) + " |")
    render_table(path, [f"# Causal-LM sweep: every MODEL_FOR_CAUSAL_LM_MAPPING_NAMES entry at {' and '.join(layouts)}",
                        "", "Generated by tests/scripts/hf_sweep.py (tiny configs: tests/helpers/hf_generic.py)."],
                 counts, rows, list(layouts), skipped, "no tiny config / one-process forward fails")


def render_table(path: Path, header: list[str], counts: dict, rows: list[str], layouts: list[str],
                skipped: dict, skipped_why: str) -> None:
    """The sweep's markdown: ``header``, the counts per layout and class, the table, the skipped models."""
    lines = [*header, ""]
    lines += [f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for name, c in counts.items()]
    lines += [f"- skipped ({skipped_why}): {len(skipped)}", "",
              "| model | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts), *rows, "",
              "## Skipped", "", *(f"- {m}: {why}".replace("|", "/") for m, why in sorted(skipped.items()))]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True, help="folder for the per-layout JSON (reused: delete to rerun)")
    p.add_argument("--table", required=True)
    p.add_argument("--only", default="", help="comma-separated model types (default: all causal LMs)")
    p.add_argument("--layouts", default="tp2,pp2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    p.add_argument("--batch", type=int, default=20)
    args = p.parse_args()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    types = args.only.split(",") if args.only else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    probe_file = work / "probe.json"
    probed = json.loads(probe_file.read_text()) if probe_file.exists() else {}
    for t in types:
        if t not in probed:
            probed[t] = probe(t)
            probe_file.write_text(json.dumps(probed, indent=1))
    skipped = {t: probed[t] for t in types if probed[t]}
    models = [f"{GENERIC}{t}:lm" for t in types if not probed[t]]
    print(f"{len(models)} models to sweep, {len(skipped)} skipped", flush=True)
    results = {}
    for name in ["ddp", *args.layouts.split(",")]:
        strategy, nprocs, extra = ("ddp", 1, ["--find-unused"]) if name == "ddp" else LAYOUTS[name]
        cache = work / f"{name}.json"
        results[name] = json.loads(cache.read_text()) if cache.exists() else {}
        todo = [m for m in models if m not in results[name]]
        if name != "ddp":
            todo = [m for m in todo if "loss" in results["ddp"].get(m, {})]
        results[name].update(run_layout(todo, strategy, nprocs, extra, args.batch) if todo else {})
        cache.write_text(json.dumps(results[name], indent=1))
    ref = {m: results["ddp"][m] for m in models if m in results["ddp"]}
    write_table(Path(args.table), skipped, ref, {k: v for k, v in results.items() if k != "ddp"})


if __name__ == "__main__":
    main()
