"""Round-7 Lightning habits, one function each: ``HABITS[name](args, workdir) -> report`` (rank 0's).

Life after ``fit``: the same Trainer's ``validate``/``test``/``predict``, a second ``fit`` of the same
module instance with a new Trainer and a new strategy (two-phase fine-tuning, also on another layout),
and what a script does with the module afterwards on rank 0 (its forward outside the Trainer, its
``state_dict``, ``save_pretrained``, ``copy.deepcopy``). Then a few more habits: the finetuning
callbacks, ``ReduceLROnPlateau`` with ``LearningRateMonitor`` and clipping by value, two validation
loaders with ``val_check_interval=0.5``, and ``resize_token_embeddings`` to a size tp does not divide.
Each on fresh Trainers (``tests/helpers/round3_habits.trainer``); tests/scripts/habits_round7.py runs
several in one launch.
"""
from __future__ import annotations

import copy

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tests.helpers.models import GPT, VOCAB, TokenDataset
from tests.helpers.round3_habits import StepLosses, trainer


def _raised(call):
    """``(value, None)`` or ``(None, "Type: message")``: a refusal is a result the test reads."""
    try:
        return call(), None
    except Exception as error:  # noqa: BLE001
        return None, f"{type(error).__name__}: {error}"


def _floats(values) -> list:
    return [float(v) for v in values]


# ---------------------------------------------------------------- 1. the same Trainer after fit
def evaluate_after_fit(args, workdir):
    """``fit`` then ``validate``, ``test`` and ``predict`` on the same Trainer and module."""
    losses, module = StepLosses(), GPT(batch_size=8 // args.dp)
    t = trainer(args, [losses], max_steps=3, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2)
    t.fit(module)
    validated = t.validate(module, verbose=False)
    tested = t.test(module, verbose=False)
    predicted = t.predict(module)
    return {"losses": losses.losses, "validated": validated, "tested": tested,
            "predicted": [float(p.sum()) for p in predicted] if t.global_rank == 0 else None}


HABITS = {"evaluate-after-fit": evaluate_after_fit}


class FrozenBackbone(GPT):
    """Two-phase fine-tuning: phase 1 trains the embeddings, final norm and head with the blocks frozen,
    phase 2 everything; the optimizer is built over the trainable parameters, as the recipes write it."""

    def freeze_blocks(self, frozen: bool) -> None:
        for p in self.blocks.parameters():
            p.requires_grad_(not frozen)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _second_fit(swap: bool):
    """Phase 1 on one Trainer, phase 2 on a new Trainer and a new strategy (``swap``: tp and pp
    exchanged), both on the same module instance."""

    def run(args, workdir):
        module = FrozenBackbone(batch_size=8 // args.dp)
        module.freeze_blocks(True)
        first = StepLosses()
        trainer(args, [first], max_steps=2, limit_val_batches=0).fit(module)
        module.freeze_blocks(False)
        second = StepLosses()
        later = copy.copy(args)
        if swap:
            later.tp, later.pp = args.pp, args.tp
        _, raised = _raised(lambda: trainer(later, [second], max_steps=2, limit_val_batches=0).fit(module))
        return {"losses": first.losses + second.losses, "first": first.losses, "raised": raised}

    return run


HABITS["second-fit"] = _second_fit(False)
HABITS["second-fit-other-layout"] = _second_fit(True)


# ---------------------------------------------------------------- 2. the module outside the Trainer
def _fitted(args):
    losses, module = StepLosses(), GPT(batch_size=8 // args.dp)
    t = trainer(args, [losses], max_steps=2, limit_val_batches=0)
    t.fit(module)
    return t, module, losses.losses


def forward_on_rank_zero(args, workdir):
    """``model.eval(); model(batch)`` on rank 0 only, after fit, as a script checks one prediction."""
    t, module, losses = _fitted(args)
    ids = TokenDataset(2, seed=5).ids
    out, raised = None, None
    if t.global_rank == 0:
        module.eval()
        out, raised = _raised(lambda: float(module(ids).sum()))
    return {"losses": losses, "out": out, "raised": raised}


def state_dict_on_rank_zero(args, workdir):
    """``model.state_dict()`` (for ``torch.save``) on rank 0 after fit; where it is refused, what the
    refusal names: ``trainer.save_checkpoint`` on every rank and ``consolidate`` on rank 0."""
    t, module, losses = _fitted(args)
    report = {"losses": losses}
    sd, raised = _raised(module.state_dict) if t.global_rank == 0 else (None, None)
    if raised is not None or t.world_size > 1 and args.strategy != "ddp":
        t.save_checkpoint(str(workdir / "ckpt"))
        if t.global_rank == 0:
            from megastrategy.checkpoint import consolidate

            sd = consolidate(str(workdir / "ckpt"))
    if t.global_rank == 0:
        torch.save(sd, workdir.parent / f"{workdir.name}.pt")
        report.update(raised=raised, shapes={k: list(v.shape) for k, v in sd.items()},
                      sums={k: float(v.float().sum()) for k, v in sd.items()})
    return report


def deepcopy_on_rank_zero(args, workdir):
    """``copy.deepcopy(model)`` on rank 0 after fit (a frozen teacher made from it), then its forward."""
    t, module, losses = _fitted(args)
    report = {"losses": losses}
    if t.global_rank == 0:
        clone, report["raised"] = _raised(lambda: copy.deepcopy(module))
        if clone is not None:
            clone.eval()
            report["out"], report["forward_raised"] = _raised(lambda: float(clone(TokenDataset(2, seed=5).ids).sum()))
    return report


def save_pretrained_on_rank_zero(args, workdir):
    """``model.model.save_pretrained(dir)`` on rank 0 after fit (a Hugging Face BERT classifier)."""
    from tests.helpers.models import BertClassifier

    losses, module = StepLosses(), BertClassifier(batch_size=8 // args.dp)
    t = trainer(args, [losses], plan=None, max_steps=2, limit_val_batches=0)
    t.fit(module)
    report = {"losses": losses.losses}
    if t.global_rank == 0:
        _, report["raised"] = _raised(lambda: module.model.save_pretrained(str(workdir / "hf")))
    return report


HABITS["forward-rank-zero"] = forward_on_rank_zero
HABITS["state-dict-rank-zero"] = state_dict_on_rank_zero
HABITS["deepcopy-rank-zero"] = deepcopy_on_rank_zero
HABITS["save-pretrained-rank-zero"] = save_pretrained_on_rank_zero
