"""Tensor-parallel plans: which submodules of the user's module are sharded, and how.

Two steps, so that every configuration error surfaces before any collective runs:

* :func:`resolve_tp_plan` (pure: no process group, nothing modified) reads the module and the
  user's ``tp_plan`` and returns a :class:`ResolvedPlan`, or raises
  :class:`~megastrategy.errors.MegatronConfigError`;
* :func:`apply_tp_plan` rewrites the module in place following the plan.

The ``tp_plan`` argument
------------------------
A dict mapping :func:`fnmatch.fnmatchcase` globs over the names of
``module.named_modules()`` (relative to the module passed in, e.g. the LightningModule:
``"model.bert.encoder.layer.*.attention.self.query"``; ``*`` also matches dots) to a style:

``"column"``
    ``nn.Linear`` / HF ``Conv1D``: output features split over the TP ranks
    (:class:`ColumnParallelLinear`). On an ``nn.Dropout`` it means "this dropout acts on
    column-sharded activations" and makes it draw from the per-TP-rank RNG stream
    (:class:`TensorParallelRegionDropout`).
``"row"``
    ``nn.Linear`` / ``Conv1D``: input features split, the partial outputs all-reduced
    (:class:`RowParallelLinear`); it consumes the output of column layers.
``"vocab"``
    an ``nn.Embedding`` (:class:`VocabParallelEmbedding`), or an ``nn.Linear`` / ``Conv1D``
    whose output is the vocabulary (:class:`VocabParallelHead`), possibly weight-tied to the
    embedding. The vocabulary need not be divisible by ``tp`` (it is padded).
``"replicate"``
    leave the module *and everything beneath it* alone.
``"auto"``
    use built-in detection (:mod:`megastrategy.layers.builtin_plans`: a Hugging Face model's
    declared plan, then class rules, then structural detection from the traced data flow,
    :mod:`megastrategy.layers.structural_plans`) for the modules the glob matches. ``{"*": "auto", ...}`` is the **combined form**: auto-detection everywhere,
    overridden by the more specific entries next to it.

Precedence
----------
* ``tp_plan=None`` is auto-detection, the same as ``{"*": "auto"}``.
* A module whose ancestor is matched by a ``"replicate"`` glob is replicated, whatever else
  matches it.
* Otherwise, among the globs that match the module itself, the **most specific** wins:
  the one with the most literal (non-wildcard) characters; on a tie, the one with fewer
  wildcards (``*``, ``?``, ``[...]``). An exact name therefore beats any glob. Two
  equally specific globs with different styles are an error.
* A module no glob matches is left alone (replicated).
* A ``tp_plan`` without an ``"auto"`` entry is **used as given**, also for a model of a known
  architecture: only what it names is sharded. Where it gives a layer of a recognized block
  the same style auto-detection would, the built-in knowledge of *how* is kept (GPT-2's
  packed QKV, head-count fix-ups, per-TP-rank attention dropout; ``column`` on a multi-query
  projection splits its query heads and keeps its key/value head whole); layers of one recognized
  block must then be sharded together or not at all.

Head-count fix-ups
------------------
The user's forward runs unchanged on the local heads, so attributes that count heads or
head-derived sizes are divided by ``tp`` on the module that owns the sharded projections
(:class:`FixUp`). Built-in blocks use their known attributes (BERT
``num_attention_heads``, ``all_head_size``; GPT-2 ``num_heads``, ``split_size``).
For other column-sharded layers the rule is: on the **parent module of each column-sharded
layer**, every ``int`` attribute named one of :data:`HEAD_ATTRS` is divided by ``tp`` (and
must be divisible). Shared ``config`` objects are never modified.

Auto-detection errors
---------------------
With auto-detection and ``tp > 1``, a model in which nothing is recognized is an error, and
so is an ``nn.Linear``/``Conv1D`` that auto-detection cannot classify **inside a repeated
block** (an element of an ``nn.ModuleList``/``nn.Sequential`` that is not the layer itself):
that is where the compute is, and silently replicating it would defeat tensor parallelism.
A stand-alone unrecognized layer (a classifier head, a pooler, ``head.0`` of a
``Sequential``) is cheap and stays replicated; so do the non-sharded layers of a recognized
Hugging Face model.

Layout
------
:mod:`.resolve` runs the passes in order: :mod:`.match` (globs, effective style),
:mod:`.drafts` (typed working entries), :mod:`.units`, :mod:`.coverage`, :mod:`.ties`,
:mod:`.sizes` (divisibility, fix-ups); :mod:`.resolved` holds the result types and
:mod:`.apply` rewrites the module.
"""
from __future__ import annotations

from megastrategy.layers.plan.apply import apply_tp_plan
from megastrategy.layers.plan.resolve import resolve_tp_plan
from megastrategy.layers.plan.resolved import FixUp, PlanEntry, ResolvedPlan, RNGRegion
from megastrategy.layers.plan.rules import AUTO, BUILTIN_ONLY_STYLES, STYLES, glob_specificity
from megastrategy.layers.plan.sizes import HEAD_ATTRS

__all__ = [
    "STYLES",
    "HEAD_ATTRS",
    "PlanEntry",
    "FixUp",
    "RNGRegion",
    "ResolvedPlan",
    "resolve_tp_plan",
    "apply_tp_plan",
    "glob_specificity",
]
