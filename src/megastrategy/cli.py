"""``megastrategy`` command line.

    megastrategy consolidate CKPT OUT.pt [--lightning]
                             [--hf-class transformers.BertForSequenceClassification
                              --hf-config DIR [--prefix model.] --hf-out DIR]
    megastrategy info CKPT
    megastrategy plan (pkg.module:Class | HF model type) [--tp 2] [--task lm|mlm|cls] [--tp-plan JSON]

``consolidate`` writes the user's full original ``state_dict`` of the sharded checkpoint
directory CKPT to OUT.pt (``torch.save``); with ``--lightning`` a single-file Lightning
checkpoint (weights, epoch, hparams) for ``LightningModule.load_from_checkpoint`` instead.
With ``--hf-class``/``--hf-config``/``--hf-out`` it also builds the Hugging Face model from
the config directory, loads the keys under ``--prefix`` and ``save_pretrained``\\ s it.
Runs in one process, no GPU or process group needed. ``plan`` prints what tensor parallelism
would shard, how, where each style comes from, and the parameters per rank
(:mod:`megastrategy.layers.plan_report`).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _consolidate(args: argparse.Namespace) -> int:
    from megastrategy.checkpoint.consolidate import consolidate, consolidate_lightning, export_hf, save_state_dict

    hf = (args.hf_class, args.hf_config, args.hf_out)
    if any(hf) and not all(hf):
        raise SystemExit("megastrategy consolidate: --hf-class, --hf-config and --hf-out go together.")
    if args.lightning:
        ckpt = consolidate_lightning(args.ckpt)
        state_dict = ckpt["state_dict"]
        save_state_dict({}, args.out, extra=ckpt)
    else:
        state_dict = consolidate(args.ckpt)
        save_state_dict(state_dict, args.out)
    numel = sum(t.numel() for t in state_dict.values())
    print(f"{args.out}: {len(state_dict)} tensors, {numel:,} elements")
    if all(hf):
        export_hf(state_dict, hf_class=args.hf_class, hf_config=args.hf_config, out_dir=args.hf_out, prefix=args.prefix)
        print(f"{args.hf_out}: {args.hf_class} (keys under {args.prefix!r})")
    return 0


def _info(args: argparse.Namespace) -> int:
    from megastrategy.checkpoint.dcp_io import read_metadata
    from megastrategy.checkpoint.sharded import MODEL, read_info

    info = read_info(args.ckpt)
    md = read_metadata(args.ckpt).state_dict_metadata
    model = {k[len(MODEL) :]: v for k, v in md.items() if k.startswith(MODEL)}
    print(f"format: {info.get('format')}, written by layout {info.get('layout')}")
    print(f"optimizers: {info.get('num_optimizers')}, pipeline stack: {info.get('stack_path')}")
    for name, m in model.items():
        print(f"  {name}: {tuple(m.size)} {m.properties.dtype} ({len(m.chunks)} chunk(s))")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from megastrategy.layers.plan_report import report_for

    print(report_for(args.model, args.tp, args.task, args.tp_plan))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megastrategy", description="megastrategy checkpoint tools")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write the full original state_dict of a sharded checkpoint")
    c.add_argument("ckpt", help="sharded checkpoint directory (written by MegatronStrategy)")
    c.add_argument("out", help="output file (torch.save)")
    c.add_argument("--lightning", action="store_true", help="write a Lightning checkpoint (weights only) instead")
    c.add_argument("--hf-class", help="e.g. transformers.BertForSequenceClassification")
    c.add_argument("--hf-config", help="directory with the model's config.json")
    c.add_argument("--prefix", default="", help="key prefix of the HF model in the state_dict, e.g. 'model.'")
    c.add_argument("--hf-out", help="directory for save_pretrained")
    c.set_defaults(fn=_consolidate)
    i = sub.add_parser("info", help="print what a sharded checkpoint holds")
    i.add_argument("ckpt")
    i.set_defaults(fn=_info)
    t = sub.add_parser("plan", help="print the tensor-parallel plan of a model at a given tp")
    t.add_argument("model", help="pkg.module:Class (built with no arguments) or a Hugging Face model type, e.g. llama")
    t.add_argument("--tp", type=int, default=2)
    t.add_argument("--task", choices=["lm", "mlm", "cls"], default="lm", help="for a model type: the Auto class")
    t.add_argument("--tp-plan", help="the strategy's tp_plan as JSON, e.g. '{\"*\": \"auto\"}'")
    t.set_defaults(fn=_plan)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
