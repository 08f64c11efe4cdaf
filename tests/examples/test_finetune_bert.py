"""examples/finetune_bert.py end to end.

The multi-process tests launch the example exactly as a user does (``python
examples/finetune_bert.py ... --devices 4``: Lightning's own subprocess launcher) on a few real
SST-2 examples: 2-way tensor x 2-way pipeline parallel training must give the same per-step
losses as one process, and its exported ``hf_model`` must reload with plain ``transformers``
and predict what the sharded model predicted. The other tests are quick, single-process checks
of the example's data handling.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "finetune_bert.py"
SST2 = REPO.parent / "shared" / "data" / "glue" / "SST-2"

needs_sst2 = pytest.mark.skipif(
    not ((SST2 / "train.tsv").is_file() and (SST2 / "dev.tsv").is_file()),
    reason=f"GLUE SST-2 not found at {SST2} (../shared/data/glue/SST-2 from the repository root); "
    "these tests train on real SST-2 examples",
)

METRIC_KEYS = {"dev_accuracy", "dev_loss", "train_loss", "steps", "tp", "pp", "dp", "samples_per_second", "minutes"}

# Small on purpose (the whole module must stay within a few minutes on 2 CPU cores): 3 steps of
# 8 sequences of at most 32 tokens, 32 dev examples, dropout off for an exact comparison.
STEPS, DEV = 3, 32
COMMON = [
    "--data-dir", str(SST2), "--max-steps", str(STEPS), "--train-samples", "48", "--dev-samples", str(DEV),
    "--seq-len", "32", "--batch-size", "8", "--val-every", str(STEPS), "--no-dropout", "--seed", "3",
]


def _load_example():
    """The example as a module (imported once; it is a script, not a package)."""
    name = "finetune_bert_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look themselves up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def run_example(args: list[str], out: Path, timeout: float) -> dict:
    """Run the example in a fresh process group; kill the whole group (every rank) on timeout."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env.update(
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]),
    )
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), *args, "--output-dir", str(out)],
            cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"killed after {timeout}s"
        finally:
            try:  # ranks that outlived rank 0 (they should not)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if code != 0:
        tail = log_path.read_text()[-6000:]
        raise AssertionError(f"finetune_bert.py {' '.join(args)}: exit {code}\n----- output (tail) -----\n{tail}")
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("finetune_bert")
    sharded = run_example([*COMMON, "--tp", "2", "--pp", "2", "--devices", "4"], base / "tp2pp2", timeout=420)
    single = run_example([*COMMON, "--devices", "1", "--no-export"], base / "single", timeout=240)
    return {"sharded": sharded, "single": single, "sharded_dir": base / "tp2pp2", "single_dir": base / "single"}


@needs_sst2
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_pp2_losses_match_one_process(runs):
    sharded, single = runs["sharded"], runs["single"]
    assert (sharded["tp"], sharded["pp"], sharded["dp"]) == (2, 2, 1)
    assert (single["tp"], single["pp"], single["dp"]) == (1, 1, 1)
    assert len(sharded["train_loss"]) == len(single["train_loss"]) == STEPS
    for step, (a, b) in enumerate(zip(sharded["train_loss"], single["train_loss"]), 1):
        assert abs(a - b) < 1e-3, f"step {step}: tp2 pp2 loss {a} vs one process {b}"
    assert abs(sharded["dev_loss"] - single["dev_loss"]) < 1e-3
    assert sharded["dev_accuracy"] == single["dev_accuracy"]


@needs_sst2
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_metrics_json_and_outputs(runs):
    for name in ("sharded", "single"):
        metrics, out = runs[name], runs[f"{name}_dir"]
        assert METRIC_KEYS <= set(metrics), f"{name}: missing {METRIC_KEYS - set(metrics)}"
        assert metrics["steps"] == STEPS and metrics["dev_examples"] == DEV
        assert all(isinstance(x, float) for x in metrics["train_loss"])
        assert 0.0 <= metrics["dev_accuracy"] <= 1.0 and metrics["samples_per_second"] > 0 and metrics["minutes"] > 0
        assert (out / "training_curves.png").stat().st_size > 0
        preds = json.loads((out / "dev_predictions.json").read_text())
        assert preds["idx"] == list(range(DEV))  # every dev example exactly once
    assert runs["sharded"]["export"]["prediction_mismatches"] == 0
    assert (runs["sharded_dir"] / "final.ckpt").exists()


@needs_sst2
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_reloads_with_plain_transformers(runs):
    from transformers import AutoTokenizer, BertForSequenceClassification

    hf_dir = runs["sharded_dir"] / "hf_model"
    model = BertForSequenceClassification.from_pretrained(hf_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    with open(SST2 / "dev.tsv", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1 : DEV + 1]
    sentences, labels = [r[0] for r in rows], [int(r[1]) for r in rows]
    enc = tokenizer(sentences, padding="longest", truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits

    recorded = json.loads((runs["sharded_dir"] / "dev_predictions.json").read_text())
    assert recorded["label"] == labels
    assert logits.argmax(-1).tolist() == recorded["prediction"]
    torch.testing.assert_close(logits, torch.tensor(recorded["logits"]), atol=1e-4, rtol=1e-4)
    accuracy = sum(int(p == y) for p, y in zip(logits.argmax(-1).tolist(), labels)) / DEV
    assert accuracy == pytest.approx(runs["sharded"]["dev_accuracy"])
    # the single-process run predicted the same
    single = json.loads((runs["single_dir"] / "dev_predictions.json").read_text())
    assert single["prediction"] == recorded["prediction"]


# ------------------------------------------------------------------ quick, single-process checks
def test_builtin_dataset_is_glue_layout_and_balanced():
    path = REPO / "examples" / "data" / "sentiment_builtin.tsv"
    with open(path, encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert rows[0] == ["sentence", "label"]
    body = rows[1:]
    assert 150 <= len(body) <= 300 and all(len(r) == 2 and r[0].strip() for r in body)
    labels = [int(r[1]) for r in body]
    assert set(labels) == {0, 1} and abs(sum(labels) - len(labels) / 2) <= len(labels) * 0.1
    assert len({r[0] for r in body}) == len(body)


def test_without_data_sst2_falls_back_loudly_and_other_tasks_stop(monkeypatch, capsys):
    fb = _load_example()
    monkeypatch.setattr(fb, "_hub_reachable", lambda timeout=3.0: False)
    train, dev, source = fb.load_splits(fb.TASKS["sst2"], None)
    assert "BUILT-IN" in source and len(train) + len(dev) == 200 and len(dev) == 40
    assert "NO REAL DATA" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--task rte: no data.*--data-dir"):
        fb.load_splits(fb.TASKS["rte"], None)


def test_pair_task_tsv_gives_token_type_ids(tmp_path):
    fb = _load_example()
    header = "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"  # GLUE MRPC, BOM included
    lines = ["1\t1\t2\tThe cat sat on the mat .\tA cat was sitting on the mat .", "0\t3\t4\tIt rained \"all\" day .\tnull"]
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / name).write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
    train, dev, _ = fb.load_splits(fb.TASKS["mrpc"], tmp_path)
    assert dev["label"] == [1, 0] and dev["text_b"][1] == "null" and '"all"' in dev["text_a"][1]

    class Tok:  # records what the collate function asks for
        def __call__(self, a, b, **kw):
            self.pairs = list(zip(a, b))
            return {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4, dtype=torch.long),
                    "token_type_ids": torch.tensor([[0, 0, 1, 1]] * 2)}

    tok = Tok()
    data = fb.GlueDataModule(train, dev, tok, seq_len=16, batch_size=2, eval_batch_size=2, seed=0)
    batch = next(iter(data.dev_dataloader()))
    assert tok.pairs[0] == ("The cat sat on the mat .", "A cat was sitting on the mat .")
    assert batch["token_type_ids"].max() == 1 and batch["idx"].tolist() == [0, 1]


def test_mnli_task_reads_dev_matched_and_string_labels(tmp_path):
    fb = _load_example()
    header = "index\tgenre\tsentence1\tsentence2\tlabel1\tgold_label\n"
    rows = ["0\tfiction\tA man walks .\tA person moves .\tentailment\tentailment",
            "1\tfiction\tA man walks .\tNobody moves .\tcontradiction\tcontradiction",
            "2\tfiction\tA man walks .\tHe is late .\tneutral\tneutral"]
    (tmp_path / "train.tsv").write_text(header + "\n".join(rows) + "\n")
    (tmp_path / "dev_matched.tsv").write_text(header + "\n".join(rows) + "\n")
    train, dev, source = fb.load_splits(fb.TASKS["mnli"], tmp_path)
    assert "dev_matched.tsv" in source and dev["label"] == [0, 2, 1] and fb.TASKS["mnli"].num_labels == 3


@pytest.mark.parametrize("n, replicas", [(872, 1), (872, 3), (10, 4), (3, 4), (33, 2)])
def test_dev_split_covers_every_example_once(n, replicas):
    fb = _load_example()
    seen = [i for rank in range(replicas) for i in fb.ShardSampler(n, replicas, rank)]
    assert sorted(seen) == list(range(n))
