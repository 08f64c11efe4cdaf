"""Probe (offline tool, not a CI test): every encoder / classifier / vision / seq2seq architecture
transformers knows, at tp=2 and at pp=2, against one device.

Why: users try architectures this repo never ran. Each must either match one device (per-step losses
within 2e-4) or be refused in setup with a clear MegatronConfigError; a crash with an unclear error,
a hang, or silently different losses is a bug. This finds them.

Models: the sequence classifiers that are not causal LMs, the masked LMs, the image classifiers and
the seq2seq LMs of transformers' task mappings, each from a generic tiny config
(tests/helpers/tiny_configs.py). The runner is tests/scripts/hf_matrix.py (many models per launch,
``--keep-going``) with the model built here instead of from the zoo. Steps: the one-process reference
(``--strategy ddp``, 1 process) -- a model whose config or one-process run fails is skipped (not our
bug) -- then ``--tp 2`` and ``--pp 2`` on 2 processes. Every launch is watched: a model that makes no
progress for ``--stall`` seconds is recorded as a hang, and the launch restarts after it.

    python tests/scripts/hf_sweep_tasks.py --table docs/sweeps/encoders_tp_pp.md [--only bert:mlm,vit:img]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("OMP_NUM_THREADS", "1")

TOL = 2e-4
#: task of the runner -> transformers' mapping of model type -> model class
_MAPPINGS = {"cls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "mlm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "img": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "s2s": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "dual": "MODEL_MAPPING_NAMES", "patches": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"}  # by --only: dual, a text-image model's contrastive loss (CLIPModel); patches, SigLIP2's images


def _mapping(task: str) -> dict:
    import transformers.models.auto.modeling_auto as auto

    return getattr(auto, _MAPPINGS[task])


def all_models() -> list[str]:
    """``arch:task`` for every architecture of the four mappings (sequence classifiers: not causal LMs)."""
    import transformers.models.auto.modeling_auto as auto

    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    out = [f"{a}:cls" for a in _mapping("cls") if a not in causal]
    return out + [f"{a}:{t}" for t in ("mlm", "img", "s2s") for a in _mapping(t)]


def build_model(arch: str, task: str):
    """The task's model class of ``arch`` from the generic tiny config; 3 labels for classifiers."""
    import warnings

    import transformers

    from tests.helpers.tiny_configs import model_class, tiny_config

    transformers.logging.set_verbosity_error()
    config = tiny_config(arch)
    if task in ("cls", "img", "patches"):
        config.num_labels = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_class(_mapping(task)[arch])(config)


def worker(argv: list[str]) -> None:
    """One rank: hf_matrix.py's runner with ``build_model`` in place of the zoo."""
    import lightning as L

    from tests.scripts import hf_matrix

    class SweepModule(hf_matrix.HFModule):
        def __init__(self, arch: str, task: str):
            L.LightningModule.__init__(self)
            self.task = task
            self.model = build_model(arch, task)

        def forward(self, batch):
            return self.model(**batch, return_loss=True) if self.task == "dual" else self.model(**batch)

    hf_matrix.HFModule = SweepModule
    if "--microbatches" in argv:  # a loss averaged over a data-dependent token count (MLM) is exact with 1
        i = argv.index("--microbatches")
        _fix_microbatches(int(argv[i + 1]))
        argv = argv[:i] + argv[i + 2:]
    keep_going = [] if os.environ.get("SWEEP_RAISE") else ["--keep-going"]  # SWEEP_RAISE=1: see the traceback
    # a head some architectures leave unused (Canine, ESM) would stop the reference, not ours to judge
    sys.argv = [sys.argv[0], *argv, *keep_going, "--find-unused"]
    hf_matrix.main()


def _fix_microbatches(n: int) -> None:
    import megastrategy

    class FixedMicrobatches(megastrategy.MegatronStrategy):
        def __init__(self, **kwargs):
            super().__init__(num_microbatches=n, **kwargs)

    megastrategy.MegatronStrategy = FixedMicrobatches


# ----------------------------------------------------------------------------------------------- driver
def _launch(models: list[str], nprocs: int, extra: list[str], stall: float) -> dict:
    """Run ``models`` in one launch (restarting after a model that stalls); result per model."""
    from tests.helpers.launch import REPO
    from tests.helpers.dist import free_port
    from tests.helpers.warm_start import ScriptProcess

    results, todo = {}, list(models)
    while todo:
        out = Path(tempfile.mkdtemp(prefix="sweep-")) / "r.json"
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs),
                   NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "src")]))
        logs = [tempfile.NamedTemporaryFile(mode="w+", prefix=f"sweep-rank{r}-") for r in range(nprocs)]
        args = ["--worker", "--out", str(out), "--models", ",".join(todo), *extra]
        procs = [ScriptProcess(__file__, args, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=str(REPO),
                               log_path=logs[r].name) for r in range(nprocs)]
        done, last = 0, time.monotonic()
        while any(p.poll() is None for p in procs) and time.monotonic() - last < stall:
            time.sleep(0.5)
            now = len(_read(out))
            if now > done:
                done, last = now, time.monotonic()
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2)
                break
        hung = any(p.poll() is None for p in procs)
        for p in procs:
            p.kill()
            p.wait()
        got = _read(out)
        results.update(got)
        todo = [m for m in todo if m not in got]
        if todo:  # the first model without a result stopped the launch
            results[todo[0]] = _why_stopped(logs, hung, stall)
            todo = todo[1:]
        print(f"  launch {extra or 'ref'}: {len(results)}/{len(models)}", flush=True)
    return results


#: the strategy's refusals (MegatronConfigError and its subclasses) as the fault handler names them
_REFUSALS = ("MegatronConfigError", "UnreachableAttributeError")


def _why_stopped(logs: list, hung: bool, stall: float) -> dict:
    """A launch that stopped: the fault handler's line ("stopping rank 0 ... because rank 1 failed ...:
    MegatronConfigError: ...") is a refusal raised in the first step on another rank; else a crash/hang."""
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
    stops = [line for t in texts for line in t.splitlines() if "[megastrategy] stopping rank" in line]
    stop = stops[-1] if stops else ""
    for refusal in _REFUSALS:
        if f"{refusal}: " in stop:
            return {"error": "(in the first step) " + stop.split(f"{refusal}: ", 1)[1], "stopped": True}
    if hung:
        return {"hang": f"no progress in {stall:.0f}s | {stop or texts[0][-1500:]}", "stopped": True}
    return {"crash": f"rank died | {stop or texts[0][-1500:]}", "stopped": True}


def _read(path: Path) -> dict:
    """Rank 0's results so far ({} while it is being written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _batches(models: list[str], size: int):
    for i in range(0, len(models), size):
        yield models[i:i + size]


def run_layout(models: list[str], nprocs: int, extra: list[str], stall: float, size: int) -> dict:
    """Results per model. A model that stopped a shared launch is run again alone: after a refusal in
    the first step a launch can leave the next model desynchronised, and the log line may be the earlier one's."""
    out = {}
    for batch in _batches(models, size):
        out.update(_launch(batch, nprocs, extra, stall))
    again = [m for m, r in out.items() if r.pop("stopped", False)] if size > 1 else []
    for model in again:
        out.update(_launch([model], nprocs, extra, stall))
    for r in out.values():
        r.pop("stopped", None)
    return out


#: layout name -> runner flags; pp2mb1: one microbatch, for losses averaged over a data-dependent token
#: count (MLM), which pp averages per microbatch as gradient accumulation does (README, "Microbatches under pp")
_LAYOUTS = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "pp2mb1": ["--pp", "2", "--microbatches", "1"]}


def classify(ref: dict, got: dict) -> tuple[str, str]:
    """match / refused / crash / hang / MISMATCH, with the message or the worst difference (the table
    calls a pp2 MISMATCH that matches with one microbatch 'microbatch-mean': a token-averaged loss)."""
    if "error" in got:
        return "refused", got["error"]
    if "crash" in got or "hang" in got:
        return ("crash", got["crash"]) if "crash" in got else ("hang", got["hang"])
    pairs = list(zip(got["loss"] + [got["val_loss"]], ref["loss"] + [ref["val_loss"]]))
    worst = max(abs(a - b) for a, b in pairs) if len(got["loss"]) == len(ref["loss"]) else float("inf")
    return ("match" if worst <= TOL else "MISMATCH"), f"{worst:.2e} {','.join(got.get('sources') or [])}"


def _one_line(text: str, n: int = 300) -> str:
    return " ".join(str(text).split())[:n].replace("|", "/")


def write_table(path: Path, ref: dict, layouts: dict) -> None:
    skipped = {m: r for m, r in ref.items() if "loss" not in r}
    lines = ["# Sweep: encoders / classifiers / vision / seq2seq at tp2 and pp2", "",
             f"Reference (1 process) trained {len(ref) - len(skipped)}, skipped {len(skipped)} (tiny config or "
             "one-process run fails: not ours).", ""]
    table = {name: {m: classify(ref[m], r) for m, r in res.items()} for name, res in layouts.items()}
    for m, (kind, detail) in table.get("pp2", {}).items():  # the documented per-microbatch mean (README)
        if kind == "MISMATCH" and table.get("pp2mb1", {}).get(m, ("",))[0] == "match":
            table["pp2"][m] = ("microbatch-mean", detail + " (exact with num_microbatches=1)")
    for name, rows in table.items():
        counts = {}
        for kind, _ in rows.values():
            counts[kind] = counts.get(kind, 0) + 1
        lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    lines += ["", "| model | " + " | ".join(table) + " |", "|---|" + "---|" * len(table)]
    for m in sorted({m for rows in table.values() for m in rows}):
        cells = [f"{rows[m][0]}: {_one_line(rows[m][1], 160)}" if m in rows else "" for rows in table.values()]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "## Skipped (reference fails)", ""]
    lines += [f"- {m}: {_one_line(r.get('crash') or r.get('hang') or r.get('error'), 200)}" for m, r in sorted(skipped.items())]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    if "--worker" in sys.argv:
        return worker([a for a in sys.argv[1:] if a != "--worker"])
    p = argparse.ArgumentParser()
    p.add_argument("--table", required=True, help="markdown file for the classified table")
    p.add_argument("--json", help="keep the raw results here (and reuse the reference found there)")
    p.add_argument("--only", help="comma-separated arch:task (default: every model of the four mappings)")
    p.add_argument("--layouts", default="tp2,pp2")
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--stall", type=float, default=120)
    p.add_argument("--render-only", action="store_true", help="only write the table from --json")
    a = p.parse_args()
    if a.render_only:
        raw = json.loads(Path(a.json).read_text())
        return write_table(Path(a.table), raw["ref"], {k: v for k, v in raw.items() if k != "ref"})
    models = a.only.split(",") if a.only else all_models()
    raw = json.loads(Path(a.json).read_text()) if a.json and Path(a.json).exists() else {}
    ref = {m: r for m, r in raw.get("ref", {}).items() if m in models}
    missing = [m for m in models if m not in ref]
    ref.update(run_layout(missing, 1, ["--strategy", "ddp"], a.stall, a.batch) if missing else {})
    good = [m for m in models if "loss" in ref[m]]
    for name in a.layouts.split(","):
        flag = _LAYOUTS[name]
        new = run_layout(good, 2, ["--strategy", "megatron", *flag], a.stall, a.batch)
        raw[name] = {**raw.get(name, {}), **new}  # a rerun of some models replaces only their rows
        raw["ref"] = {**raw.get("ref", {}), **ref}
        if a.json:
            Path(a.json).write_text(json.dumps(raw, indent=1))
        write_table(Path(a.table), raw["ref"], {k: v for k, v in raw.items() if k != "ref"})


if __name__ == "__main__":
    main()
    from tests.helpers.script_args import leave_without_static_destructors

    leave_without_static_destructors()
