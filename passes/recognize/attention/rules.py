"""The attention recognition rules, by family, and the rule sets
:class:`~tfgraph.passes.recognize.attention.fuse.FuseAttentionPass` applies in order:

- :mod:`.score_masks` (``MASK_RULES``, ``BIAS_RULES``): masked or biased scores brought to one
  additive bias;
- :mod:`.core` and :mod:`.batched_heads` (``CORE_RULES``; ``FLAT_RULES`` where they left a
  core unfused): an attention core into ONE canonical ``tfgraph.Attention``;
- :mod:`.kv_layouts` (``LAYOUT_RULES``): transposes of K cancelled, ``repeat_kv`` absorbed.

The rule classes are importable from here as well.
"""

from __future__ import annotations

from tfgraph.passes.recognize.attention.batched_heads import (
    BatchedHeadsAttentionRule,
    BatchedScoresAttentionRule,
    BmmAttentionRule,
    ViewedBmmAttentionRule,
    _batched_heads,
)
from tfgraph.passes.recognize.attention.core import (
    AttentionRule,
    _flat_attention,
    _flat_batches,
    _rank4_static_heads,
)
from tfgraph.passes.recognize.attention.kv_layouts import (
    DoubleTransposeRule,
    RepeatKVRule,
    SdpaKeyLayoutRule,
)
from tfgraph.passes.recognize.attention.score_masks import (
    MaxShiftRule,
    MultiplicativeMaskRule,
    SelectionMaskRule,
    StackedBiasRule,
    ZeroMaskedProbsRule,
    _from_scores,
    _is_fill,
    _selects_with,
    _zero_one_constant,
)

__all__ = [
    "BIAS_RULES",
    "CORE_RULES",
    "FLAT_RULES",
    "LAYOUT_RULES",
    "MASK_RULES",
    "AttentionRule",
    "BatchedHeadsAttentionRule",
    "BatchedScoresAttentionRule",
    "BmmAttentionRule",
    "DoubleTransposeRule",
    "MaxShiftRule",
    "MultiplicativeMaskRule",
    "RepeatKVRule",
    "SdpaKeyLayoutRule",
    "SelectionMaskRule",
    "StackedBiasRule",
    "ViewedBmmAttentionRule",
    "ZeroMaskedProbsRule",
    "_batched_heads",
    "_flat_attention",
    "_flat_batches",
    "_from_scores",
    "_is_fill",
    "_rank4_static_heads",
    "_selects_with",
    "_zero_one_constant",
]

MASK_RULES = [
    MaxShiftRule.rule(),
    *(MultiplicativeMaskRule.rule(f) for f in (False, True)),
    *(ZeroMaskedProbsRule.rule(f) for f in (False, True)),
    *(SelectionMaskRule.rule(f, b) for f in (False, True) for b in ("", "right", "left")),
]
BIAS_RULES = [StackedBiasRule.rule(i, o) for i in (True, False) for o in (True, False)]
CORE_RULES = [
    *(AttentionRule.rule(b, g) for b in (True, False) for g in (True, False)),
    *(AttentionRule.rule(b, False, sink=True) for b in (True, False)),
    BatchedHeadsAttentionRule.rule(),
    BatchedScoresAttentionRule.rule(),
    *(ViewedBmmAttentionRule.rule(e, m) for e in (True, False) for m in (True, False)),
    *(BmmAttentionRule.rule(True, c, r) for c in (True, False) for r in (True, False)),
    *(BmmAttentionRule.rule(False, False, r) for r in (True, False)),
]
# Tried only where CORE_RULES left a core unfused: a view that recovers the heads
# (:class:`BmmAttentionRule`) must win over folding them into the batch.
FLAT_RULES = [AttentionRule.rule(b, g, flat=True) for b in (True, False) for g in (True, False)]
LAYOUT_RULES = [
    DoubleTransposeRule.rule(),
    SdpaKeyLayoutRule.rule(),
    RepeatKVRule.rule(),
]
