"""Render the Hugging Face test matrix's results as the README's Markdown table.

    HF_MATRIX_JSON=/tmp/hf_matrix.json python -m pytest tests/layers/test_hf_matrix.py
    python tests/scripts/render_hf_matrix.py /tmp/hf_matrix.json
"""
from __future__ import annotations

import json
import sys

_TASKS = {"lm": "ForCausalLM", "mlm": "ForMaskedLM", "cls": "ForSequenceClassification", "s2s": "ForSeq2SeqLM"}


def _row(model: str, ref: dict, got: dict) -> str:
    arch, task = model.split(":")
    name = f"{arch} (`AutoModel{_TASKS[task]}`)"
    if "error" in got:
        block = got["error"].split("block ", 1)[-1].split(" ", 1)[0]
        reason = got["error"].split("random input: ", 1)[-1].split(". Refusing")[0]
        return f"| {name} | declared by transformers | refused in setup, block {block}: {reason[:120]} |"
    diffs = [abs(a - b) for a, b in zip(got["loss"] + [got["val_loss"]], ref["loss"] + [ref["val_loss"]])]
    source = ", ".join(s.replace("declared:", "declared by transformers (").replace("auto:", "built-in (")
                       .replace("structural:", "structural detection (") + ")"
                       for s in got["sources"])
    return f"| {name} | {source} | {max(diffs):.1e} |"


def render(results: dict) -> str:
    ref, tp2 = results["ddp"], results["tp2"]
    lines = [
        "| model (tiny config, loss from `labels=`) | TP plan source | tp2 vs one device: max abs. difference of 3 step losses and the val loss |",
        "| --- | --- | --- |",
    ]
    lines += [_row(model, ref[model], tp2[model]) for model in tp2]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
