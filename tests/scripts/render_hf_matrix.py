"""Render the Hugging Face test matrix's results as the README's Markdown table.

    HF_MATRIX_JSON=/tmp/hf_matrix.json python -m pytest tests/layers/test_hf_matrix.py
    python tests/scripts/render_hf_matrix.py /tmp/hf_matrix.json

The pp=2 test writes ``/tmp/hf_matrix.pp2.json`` next to it; when it is there the table gets a
pp2 column.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

_TASKS = {"lm": "ForCausalLM", "mlm": "ForMaskedLM", "cls": "ForSequenceClassification", "s2s": "ForSeq2SeqLM",
          "tok": "ForTokenClassification", "qa": "ForQuestionAnswering", "mc": "ForMultipleChoice",
          "img": "ForImageClassification", "audio": "ForAudioClassification", "ctc": "ForCTC", "asr": "ForSpeechSeq2Seq"}


def _refusal(error: str) -> str:
    """The reason in a few words: the block and what its sharded forward did, or the message's start."""
    if "random input: " in error:
        block = error.split("block ", 1)[-1].split(" ", 1)[0]
        return f"block {block}: {error.split('random input: ', 1)[-1].split('. Refusing')[0][:120]}"
    return error.split(": ", 1)[-1].split(". ")[0][:160]


def _cell(model: str, ref: dict, got: dict | None) -> str:
    if got is None:
        return ""
    if "error" in got:
        return f"refused in setup, {_refusal(got['error'])}"
    diffs = [abs(a - b) for a, b in zip(got["loss"] + [got["val_loss"]], ref["loss"] + [ref["val_loss"]])]
    return f"{max(diffs):.1e}"


def _source(got: dict | None) -> str:
    if got is None or "error" in got:
        return "declared by transformers" if got is not None and "declared:" in got["error"] else ""
    return ", ".join(s.replace("declared:", "declared by transformers (").replace("auto:", "built-in (")
                     .replace("structural:", "structural detection (") + ")" for s in got["sources"])


def render(results: dict, pp2: dict | None = None) -> str:
    ref, tp2 = results["ddp"], results["tp2"]
    pp = (pp2 or {}).get("pp2", {})
    lines = [
        "| model (tiny config, loss from `labels=`) | TP plan source | max abs. difference of 3 step losses and "
        "the val loss: tp2 vs one device | pp2 vs one device |",
        "| --- | --- | --- | --- |",
    ]
    for model in list(tp2) + [m for m in pp if m not in tp2]:
        arch, task = model.split(":")
        source = _source(tp2.get(model)) or _source(pp.get(model))
        row = [f"{arch} (`AutoModel{_TASKS[task]}`)", source, _cell(model, ref.get(model), tp2.get(model)),
               _cell(model, ref.get(model), pp.get(model))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1])
    pp2_path = path.with_suffix(".pp2.json")
    pp2 = json.loads(pp2_path.read_text()) if pp2_path.exists() else None
    print(render(json.loads(path.read_text()), pp2))
