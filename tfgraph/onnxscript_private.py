"""Every private onnxscript API tfgraph uses, in one place, each with why no public one serves.

onnxscript 0.7 exposes ``onnxscript.optimizer.optimize_ir`` as one call with a fixed rule list;
tfgraph needs the same optimizer with a different list, so it needs the parts:

- :data:`DEFAULT_REWRITE_RULES` (``onnxscript.rewriter._DEFAULT_REWRITE_RULES``): the list
  ``optimize_ir`` applies. tfgraph drops ``SlicesSplit`` (quadratic in depth, measured) and
  swaps the tolerant no-op rules for exact ones; there is no public accessor for the list.
- :data:`FoldConstantsPass` and the size limits (``onnxscript.optimizer._constant_folding``):
  the folding pass ``optimize_ir`` runs, which is public only inside ``optimize_ir``.
- :data:`NO_OP_RULES` (``onnxscript.rewriter.rules.common._no_op``): the tolerant rules to find
  and replace in the default list (``x + 1e-12`` counts as a no-op there).

When onnxscript makes these public, only this module changes.
"""

from __future__ import annotations

from onnxscript import rewriter as _rewriter
from onnxscript.optimizer import _constant_folding
from onnxscript.rewriter.rules.common import _no_op

DEFAULT_REWRITE_RULES = _rewriter._DEFAULT_REWRITE_RULES
FoldConstantsPass = _constant_folding.FoldConstantsPass
FOLD_INPUT_SIZE_LIMIT = _constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
FOLD_OUTPUT_SIZE_LIMIT = _constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT
NO_OP_RULES = _no_op
