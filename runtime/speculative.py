"""Speculative decoding's pure core: which drafted tokens a target model accepts, and how many to
draft next (issue 49). No model runs here: :mod:`.drafters` proposes tokens,
:mod:`.speculative_loop` verifies them with one step of the target over its cache.

A drafter proposes ``d1..dk`` after the context; the target runs ``[last, d1..dk]`` in one step
(``k + 1`` new tokens: on a CPU the weights are read once, so the step costs little more than a
one-token step) and its logits row ``i`` is the distribution of the token after ``d1..di``.

- Greedy (:func:`accept_greedy`): ``d(i+1)`` is accepted while it equals the target's argmax at
  row ``i``; the first mismatch emits the target's argmax instead, and when all ``k`` are
  accepted row ``k`` gives one more token (the bonus). The emitted tokens are exactly what plain
  greedy decoding would emit (argmax ties aside).
- Sampled (:func:`accept_sampled`), the standard rejection rule (Leviathan et al. 2023, Chen et
  al. 2023): with ``p`` the target's and ``q`` the draft's distribution at a position, the
  drafted ``x`` is accepted with probability ``min(1, p(x) / q(x))``; on rejection the token is
  drawn from ``normalize(max(0, p - q))`` and drafting stops; after all ``k`` are accepted a
  bonus token is drawn from ``p`` of row ``k``. Every emitted token is then distributed as the
  target's own sample. A deterministic drafter (prompt lookup) has ``q`` one-hot: ``x`` is
  accepted with probability ``p(x)``, and the residual is ``p`` with ``x`` removed.
  ``p`` and ``q`` are both taken after the same temperature / top-k / top-p transform as
  :func:`tfgraph.runtime.generate.choose` (:func:`probabilities`).

The result of either is the list of tokens to emit: the accepted drafts and one more (the
correction or the bonus), so ``len(result) - 1`` drafts were accepted.

How many to draft (:class:`DraftLength`): a fixed ``k``, or adapted — after a verify step that
accepted all ``k`` drafts, ``k`` grows by one (up to ``k_max``); after one that accepted fewer
than half of them, it shrinks by one (down to ``k_min``); otherwise it stays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tfgraph.errors import TfgraphError
from tfgraph.runtime.generate import probabilities

__all__ = [
    "DraftLength",
    "SpeculativeStats",
    "accept_greedy",
    "accept_sampled",
    "probabilities",
]


def _check(draft: Sequence[int], target_logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(target_logits)
    if logits.ndim != 2 or logits.shape[0] != len(draft) + 1:
        raise TfgraphError(
            f"the target's logits must be (k + 1, vocab) = ({len(draft) + 1}, vocab) for "
            f"{len(draft)} drafted tokens, got {tuple(logits.shape)}"
        )
    return logits


def accept_greedy(draft: Sequence[int], target_logits: np.ndarray) -> list[int]:
    """The tokens to emit after a greedy verify step: the drafts up to the first one that is not
    the target's argmax, then the target's argmax there (or the bonus after all ``k``).
    ``target_logits``: (k + 1, vocab), row ``i`` the target's logits after ``d1..di``."""
    best = _check(draft, target_logits).argmax(-1)
    out = []
    for i, token in enumerate(draft):
        if int(token) != int(best[i]):
            break
        out.append(int(token))
    out.append(int(best[len(out)]))
    return out


def accept_sampled(
    draft: Sequence[int],
    draft_probs: np.ndarray | None,
    target_logits: np.ndarray,
    config,
    rng: np.random.Generator,
) -> list[int]:
    """The tokens to emit after a sampled verify step, by the rejection rule (module doc).
    ``draft_probs``: (k, vocab) the draft's distribution at each drafted position (after the
    same transform), or ``None`` for a deterministic drafter (``q`` one-hot)."""
    p = probabilities(_check(draft, target_logits), config)
    if draft_probs is not None and np.shape(draft_probs) != (len(draft), p.shape[1]):
        raise TfgraphError(
            f"draft_probs must be (k, vocab) = ({len(draft)}, {p.shape[1]}), "
            f"got {tuple(np.shape(draft_probs))}"
        )
    out = []
    for i, token in enumerate(draft):
        x = int(token)
        if draft_probs is None:
            q = np.zeros(p.shape[1])
            q[x] = 1.0
        else:
            q = np.asarray(draft_probs[i], np.float64)
        ratio = p[i, x] / q[x] if q[x] > 0 else 0.0  # q(x) = 0: the draft could not draw x
        if rng.random() < min(1.0, ratio):
            out.append(x)
            continue
        residual = np.maximum(p[i] - q, 0.0)
        total = residual.sum()
        # p <= q everywhere only when p == q, where x is never rejected; guard rounding
        row = residual / total if total > 0 else p[i]
        out.append(int(rng.choice(row.shape[0], p=row)))
        return out
    out.append(int(rng.choice(p.shape[1], p=p[len(draft)])))
    return out


@dataclass
class DraftLength:
    """How many tokens to draft: ``k`` fixed, or ``adaptive`` between ``k_min`` and ``k_max``
    (grow by one on full acceptance, shrink by one when fewer than half were accepted)."""

    k: int = 4
    adaptive: bool = False
    k_min: int = 1
    k_max: int = 8

    def __post_init__(self) -> None:
        if self.k < 1:
            raise TfgraphError(f"the speculative k must be at least 1, got {self.k}")
        if self.adaptive and not self.k_min <= self.k <= self.k_max:
            raise TfgraphError(
                f"the adaptive k must start in [{self.k_min}, {self.k_max}], got {self.k}"
            )

    def update(self, proposed: int, accepted: int) -> None:
        """After a verify step that had ``proposed`` drafts and accepted ``accepted``."""
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:
            self.k = min(self.k + 1, self.k_max)
        elif 2 * accepted < proposed:
            self.k = max(self.k - 1, self.k_min)


@dataclass
class SpeculativeStats:
    """Counters of a speculative run: verify steps, drafted and accepted tokens, emitted."""

    verify_steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    ks: list[int] = field(default_factory=list)

    def record(self, proposed: int, emitted: int) -> None:
        """One verify step: ``proposed`` drafts, ``emitted`` tokens out of it (accepted + 1)."""
        self.verify_steps += 1
        self.proposed += proposed
        self.accepted += emitted - 1
        self.emitted += emitted
        self.ks.append(proposed)

    @property
    def acceptance(self) -> float:
        """Accepted drafts / proposed drafts (0 when none were proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verify step (1 is plain decoding's)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def summary(self) -> str:
        return (
            f"speculative: {self.verify_steps} verify steps, acceptance {self.acceptance:.1%} "
            f"({self.accepted}/{self.proposed}), {self.tokens_per_step:.2f} tokens per step"
        )
