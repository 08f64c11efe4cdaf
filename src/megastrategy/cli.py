"""``megastrategy`` command line.

    megastrategy consolidate CKPT OUT.pt [--lightning]
                             [--hf-class transformers.BertForSequenceClassification
                              --hf-config DIR [--prefix model.] --hf-out DIR]
    megastrategy info CKPT
    megastrategy export CKPT OUT_DIR [--strip model.] [--hf-config DIR] [--max-shard-mb 2048]
    megastrategy check package.module:MyModule --devices 4 --tp 2 --pp 2 [--steps 5]
                       [--module-args JSON] [--datamodule package.module:MyData --datamodule-args JSON]
    megastrategy plan (pkg.module:Class | HF model type) [--tp 2] [--ep 1] [--task lm|mlm|cls] [--tp-plan JSON]

``consolidate`` writes the user's full original ``state_dict`` of the sharded checkpoint
directory CKPT to OUT.pt (``torch.save``); with ``--lightning`` a single-file Lightning
checkpoint (weights, epoch, hparams) for ``LightningModule.load_from_checkpoint`` instead.
With ``--hf-class``/``--hf-config``/``--hf-out`` it also builds the Hugging Face model from
the config directory, loads the keys under ``--prefix`` and ``save_pretrained``\\ s it.
Runs in one process, no GPU or process group needed. ``plan`` prints what tensor parallelism
would shard, how, where each style comes from, and the parameters per rank
(:mod:`megastrategy.layers.plan_report`).

``export`` streams the weights into safetensors shards of bounded size, one whole tensor at a time
(never the whole model in memory); with ``--hf-config`` it adds the config, for ``from_pretrained``.

``check`` trains the module a few steps under ``DDPStrategy`` and under the layout, from the same
seed, prints per-step loss and gradient-norm differences and exits 1 when they disagree.
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


def _export(args: argparse.Namespace) -> int:
    from megastrategy.checkpoint.sharded import MODEL, read_info
    from megastrategy.checkpoint.streaming import write_safetensors_shards

    read_info(args.ckpt)  # a clear error for a DCP checkpoint that megastrategy did not write
    index = write_safetensors_shards(args.ckpt, args.out, prefix=MODEL, strip=args.strip,
                                     max_shard_bytes=int(args.max_shard_mb * 1024**2))
    if args.hf_config:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(args.hf_config).save_pretrained(args.out)
    files = sorted(set(index["weight_map"].values()))
    print(f"{args.out}: {len(index['weight_map'])} tensors, {index['metadata']['total_size']:,} bytes in {len(files)} file(s)")
    return 0


def _check(args: argparse.Namespace) -> int:
    import json

    from megastrategy.parity import ParityRun, run_check
    from megastrategy.parity.launch import RanksFailed

    run = ParityRun(module=args.module, module_args=json.loads(args.module_args), datamodule=args.datamodule,
                    datamodule_args=json.loads(args.datamodule_args), steps=args.steps, seed=args.seed,
                    dropout_off=not args.keep_dropout, tolerance=args.tolerance, timeout=args.timeout)
    layout = {k: getattr(args, k) for k in ("tp", "pp", "cp", "ep", "vp") if getattr(args, k) is not None}
    layout.update(json.loads(args.strategy_args))
    try:
        report = run_check(run, layout, args.devices)
    except RanksFailed as failure:
        print(f"megastrategy check: a run did not finish, so there is no verdict.\n{failure}", file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.passed else 1


def _add_check(sub) -> None:
    k = sub.add_parser("check", help="train a module on a layout and on DDP from the same seed; compare per step")
    k.add_argument("module", help="import path of the LightningModule class, e.g. my_project.models:MyModule")
    k.add_argument("--devices", type=int, required=True, help="processes for the layout (the world size)")
    for name in ("tp", "pp", "cp", "ep", "vp"):
        k.add_argument(f"--{name}", type=int, default=None)
    k.add_argument("--strategy-args", default="{}", help="other MegatronStrategy keywords, as JSON")
    k.add_argument("--module-args", default="{}", help="keyword arguments of the module's constructor, as JSON")
    k.add_argument("--datamodule", help="import path of a LightningDataModule class (default: the module's loaders)")
    k.add_argument("--datamodule-args", default="{}", help="keyword arguments of the datamodule, as JSON")
    k.add_argument("--steps", type=int, default=5)
    k.add_argument("--seed", type=int, default=1234)
    k.add_argument("--tolerance", type=float, default=2e-4, help="largest loss / relative grad-norm difference")
    k.add_argument("--keep-dropout", action="store_true", help="leave dropout on (then only statistics can agree)")
    k.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take before it is stopped")
    k.set_defaults(fn=_check)


def _plan(args: argparse.Namespace) -> int:
    from megastrategy.layers.plan_report import report_for

    print(report_for(args.model, args.tp, args.task, args.tp_plan, ep=args.ep))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megastrategy", description="megastrategy tools: checkpoints, TP plans and parity checks")
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
    e = sub.add_parser("export", help="stream the weights into safetensors shards (Hugging Face layout)")
    e.add_argument("ckpt", help="sharded checkpoint directory (written by MegatronStrategy)")
    e.add_argument("out", help="output directory")
    e.add_argument("--strip", default="", help="prefix removed from the names, e.g. 'model.' for self.model")
    e.add_argument("--hf-config", help="a directory or config.json source: its config is saved beside the weights")
    e.add_argument("--max-shard-mb", type=float, default=2048, help="largest shard file (a larger tensor gets its own)")
    e.set_defaults(fn=_export)
    _add_check(sub)
    t = sub.add_parser("plan", help="print the tensor-parallel plan of a model at a given tp")
    t.add_argument("model", help="pkg.module:Class (built with no arguments) or a Hugging Face model type, e.g. llama")
    t.add_argument("--tp", type=int, default=2)
    t.add_argument("--ep", type=int, default=1, help="expert parallelism: Hugging Face fused experts split over ep")
    t.add_argument("--task", choices=["lm", "mlm", "cls", "s2s"], default="lm", help="for a model type: the Auto class")
    t.add_argument("--tp-plan", help="the strategy's tp_plan as JSON, e.g. '{\"*\": \"auto\"}'")
    t.set_defaults(fn=_plan)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
