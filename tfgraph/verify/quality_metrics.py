"""The figures a quantized model is judged by, against its fp32 reference, over a text: the
ones llama.cpp's ``perplexity --kl-divergence`` reports and users compare.

- **perplexity** of each model: ``exp(mean NLL)`` of the text's next tokens;
- **ΔPPL**: the artifact's minus the reference's (and relative, in percent);
- **KL divergence** ``KL(reference ‖ artifact)`` of the next-token distributions, mean and max
  over positions (nats);
- **top-1 agreement**: the share of positions where both rank the same token first.

:class:`QualityTally` accumulates them window by window (logits of ``(T, V)`` each), in
float64, so a long text never needs both models' logits at once.
"""

from __future__ import annotations

import math

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``(T, V)`` logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


class QualityTally:
    """Sums over positions of one artifact against its reference (module docstring)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.nll_ref = 0.0
        self.nll = 0.0
        self.kl_sum = 0.0
        self.kl_max = 0.0
        self.same_top = 0

    def add(self, reference: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        """Positions ``t`` of one window: ``reference[t]``, ``logits[t]`` (``(T, V)``) predict
        ``targets[t]`` (``(T,)``: the token after position ``t``)."""
        if reference.shape != logits.shape or reference.shape[0] != len(targets):
            raise ValueError(
                f"quality: reference {reference.shape}, logits {logits.shape} and "
                f"{len(targets)} targets do not line up"
            )
        ref, got = log_softmax(reference), log_softmax(logits)
        rows = np.arange(len(targets))
        targets = np.asarray(targets, dtype=np.int64)
        self.nll_ref -= float(ref[rows, targets].sum())
        self.nll -= float(got[rows, targets].sum())
        kl = (np.exp(ref) * (ref - got)).sum(axis=-1)
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.same_top += int((ref.argmax(axis=-1) == got.argmax(axis=-1)).sum())
        self.tokens += len(targets)

    def figures(self) -> dict:
        """The figures so far (``ppl``, ``ppl_ref``, ``delta_ppl``, ``delta_ppl_pct``,
        ``kl_mean``, ``kl_max``, ``top1``, ``tokens``)."""
        if not self.tokens:
            raise ValueError("quality: no positions were measured (the text is too short)")
        ppl_ref = math.exp(self.nll_ref / self.tokens)
        ppl = math.exp(self.nll / self.tokens)
        return {
            "tokens": self.tokens,
            "ppl_ref": ppl_ref,
            "ppl": ppl,
            "delta_ppl": ppl - ppl_ref,
            "delta_ppl_pct": 100.0 * (ppl - ppl_ref) / ppl_ref,
            "kl_mean": self.kl_sum / self.tokens,
            "kl_max": self.kl_max,
            "top1": self.same_top / self.tokens,
        }
