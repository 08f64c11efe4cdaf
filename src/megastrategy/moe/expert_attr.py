"""The attribute name under which an MoE expert parameter carries its ``ExpertParamInfo``.

Its own module so that the experts (which set it) and checkpoint layouts (which read it)
share one spelling without the checkpoint code depending on the expert layers.
"""
from __future__ import annotations

__all__ = ["EXPERT_ATTR"]

#: attribute of MoE expert parameters (``megastrategy.moe.experts.ExpertParamInfo``): global expert
#: index, and the dimension split over expert-TP (``etp_dim``, ``etp_size``, ``etp_rank``)
EXPERT_ATTR = "megastrategy_expert"
