"""Speculative decoding (runtime/speculative*.py, runtime/drafters.py): the acceptance rules,
the drafters, rollback of a shared buffer and of a recurrent state, greedy output equal to plain
decoding, and sampled output distributed as the target's (enumerated exactly on toy decoders,
with a bound the rule meets and a broken rule does not)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.runtime.speculative_fakes import RecurrentFake, SharedFake, tables
from tfgraph.errors import TfgraphError
from tfgraph.runtime import speculative_loop
from tfgraph.runtime.drafters import DraftModel, PromptLookup, check_same_tokenizer
from tfgraph.runtime.generate import GenerationConfig, choose
from tfgraph.runtime.speculative import (
    DraftLength,
    SpeculativeStats,
    accept_greedy,
    accept_sampled,
    probabilities,
)
from tfgraph.runtime.speculative_loop import speculative_generate

VOCAB = 4


def test_accept_greedy_keeps_drafts_up_to_the_first_mismatch():
    logits = np.eye(6)[[5, 0, 2, 1]] * 3  # argmax rows: 5, 0, 2, 1
    assert accept_greedy([5, 0, 3], logits) == [5, 0, 2]  # d3 rejected: the target's 2
    assert accept_greedy([5, 0, 2], logits) == [5, 0, 2, 1]  # all accepted + the bonus
    assert accept_greedy([4, 0, 2], logits) == [5]  # the first rejected
    with pytest.raises(TfgraphError, match=r"\(k \+ 1, vocab\)"):
        accept_greedy([1, 2], logits)


def test_probabilities_are_what_choose_samples_from():
    logits = np.random.default_rng(3).standard_normal((3, 9)) * 2
    for config in (
        GenerationConfig(do_sample=True, temperature=0.7),
        GenerationConfig(do_sample=True, top_k=3),
        GenerationConfig(do_sample=True, top_p=0.6, temperature=1.3),
    ):
        probs = probabilities(logits, config)
        for seed in range(5):  # the same generator state draws the same token from either
            got = choose(logits, config, np.random.default_rng(seed))
            rng = np.random.default_rng(seed)
            want = [rng.choice(9, p=row) for row in probs]
            assert got.tolist() == want


def test_the_rejection_rule_emits_the_targets_distribution():
    """One position: p(first emitted) must equal the target's p whatever q is (deterministic
    q included); 10 000 draws per q, every cell within 5 standard errors."""
    rng = np.random.default_rng(0)
    config = GenerationConfig(do_sample=True)
    target = rng.standard_normal((2, 5)) * 1.5
    p = probabilities(target, config)[0]
    n = 10_000
    for q in (probabilities(rng.standard_normal((1, 5)), config), None):
        counts = np.zeros(5)
        for _ in range(n):
            if q is None:
                draft = [2]
            else:
                draft = [int(rng.choice(5, p=q[0]))]
            counts[accept_sampled(draft, q, target, config, rng)[0]] += 1
        assert np.all(np.abs(counts / n - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-12)


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    lookup = PromptLookup(max_ngram=3)
    assert lookup.propose([7, 1, 2, 3, 4, 9, 1, 2, 3], 2) == ([4, 9], None)
    # the latest earlier match wins, and a shorter n-gram when the longer is not found
    assert lookup.propose([5, 8, 5, 6, 0, 5], 3) == ([6, 0, 5], None)
    assert lookup.propose([1, 2, 3], 4) == ([], None)
    with pytest.raises(TfgraphError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def test_adaptive_draft_length_grows_on_full_acceptance_and_shrinks_on_early_rejection():
    length = DraftLength(k=4, adaptive=True, k_min=2, k_max=5)
    length.update(4, 4)
    assert length.k == 5
    length.update(5, 5)
    assert length.k == 5  # at k_max
    length.update(5, 1)
    assert length.k == 4
    length.update(4, 2)
    assert length.k == 4  # half accepted: stays
    fixed = DraftLength(k=3)
    fixed.update(3, 0)
    assert fixed.k == 3
    with pytest.raises(TfgraphError, match="at least 1"):
        DraftLength(k=0)


def _prompt_with_repeats() -> list[int]:
    return [1, 2, 3, 0, 1, 2, 3, 0, 2, 1]


@pytest.mark.parametrize("fake", [SharedFake, RecurrentFake])
@pytest.mark.parametrize("drafter", ["lookup", "draft", "self"])
def test_greedy_tokens_equal_plain_decoding(fake, drafter):
    target = fake(*tables(VOCAB, seed=1))
    if drafter == "lookup":
        proposer = PromptLookup()
    else:
        proposer = DraftModel(target if drafter == "self" else fake(*tables(VOCAB, seed=2)))
    stats = SpeculativeStats()
    config = GenerationConfig(max_new_tokens=40)
    got = speculative_generate(target, _prompt_with_repeats(), proposer, config, stats=stats)
    assert got == target.reference(_prompt_with_repeats(), 40)
    assert stats.emitted == 39 and stats.verify_steps < 39  # fewer target steps than tokens
    if drafter == "self":
        assert stats.acceptance == 1.0
    elif drafter == "draft":
        assert 0 < stats.acceptance < 1  # some rejected: the rollback was exercised


def test_a_recurrent_state_is_restored_and_the_accepted_tokens_rerun(monkeypatch):
    target = RecurrentFake(*tables(VOCAB, seed=1))
    reruns = []
    original = speculative_loop.TrackedCache.truncate

    def spy(self, length):
        before = self.reruns
        original(self, length)
        reruns.append(self.reruns - before)

    monkeypatch.setattr(speculative_loop.TrackedCache, "truncate", spy)
    draft = DraftModel(RecurrentFake(*tables(VOCAB, seed=2)))
    got = speculative_generate(target, [1, 2], draft, GenerationConfig(max_new_tokens=30))
    assert got == target.reference([1, 2], 30)
    assert any(reruns), "no partial acceptance re-ran a restored state"


def test_eos_stops_and_max_new_tokens_bounds_every_round():
    target = SharedFake(*tables(VOCAB, seed=1))
    plain = target.reference([1, 2], 30)
    eos = plain[7]
    config = GenerationConfig(max_new_tokens=30, eos_token_id=eos)
    got = speculative_generate(target, [1, 2], DraftModel(target), config)
    assert got == plain[: plain.index(eos) + 1]
    for n in (1, 2, 5):
        config = GenerationConfig(max_new_tokens=n)
        assert speculative_generate(target, [1, 2], DraftModel(target), config) == plain[:n]


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    with pytest.raises(TfgraphError, match="vocabulary"):
        check_same_tokenizer(tmp_path, tmp_path, 6144, 512)
    for name, text in (("target", "{}"), ("draft", '{"x": 1}')):
        (tmp_path / name / "tokenizer").mkdir(parents=True)
        (tmp_path / name / "tokenizer" / "tokenizer.json").write_text(text)
    with pytest.raises(TfgraphError, match="tokenizer.json"):
        check_same_tokenizer(tmp_path / "target", tmp_path / "draft", 10, 10)
    (tmp_path / "draft" / "tokenizer" / "tokenizer.json").write_text("{}")
    check_same_tokenizer(tmp_path / "target", tmp_path / "draft", 10, 10)


def test_a_concat_cache_is_refused_in_one_line():
    target = SharedFake(*tables(VOCAB, seed=1))
    target.session.signature.shared_buffer = False
    with pytest.raises(TfgraphError, match="shared-buffer"):
        speculative_generate(target, [1], PromptLookup(), GenerationConfig(max_new_tokens=3))


# -- sampled output: the exact distribution of the first three tokens --------------------------

SAMPLED = GenerationConfig(max_new_tokens=3, do_sample=True, temperature=0.8, top_k=3)
RUNS = 2500


def _exact(target, prompt: list[int]) -> np.ndarray:
    """P(t1, t2, t3) of plain sampling from ``target`` (enumerated)."""
    joint = np.zeros((VOCAB,) * 3)

    def dist(previous, last):
        return probabilities(target.logits(previous, last)[None], SAMPLED)[0]

    p1 = dist(prompt[-2], prompt[-1])
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        p2 = dist(prompt[-1], t1)
        joint[t1, t2] = p1[t1] * p2[t2] * dist(t1, t2)
    return joint


def _empirical(target, draft_fake, prompt, k: int) -> np.ndarray:
    counts = np.zeros((VOCAB,) * 3)
    for seed in range(RUNS):
        config = GenerationConfig(**{**SAMPLED.__dict__, "seed": seed})
        draft = DraftModel(draft_fake, seed=10**6 + seed)
        tokens = speculative_generate(target, prompt, draft, config, length=DraftLength(k=k))
        counts[tuple(tokens)] += 1
    return counts / RUNS


def _within(freq: np.ndarray, exact: np.ndarray) -> bool:
    """Every cell within 5 binomial standard errors of its probability (a cell of probability
    0 must be empty): under the right distribution a miss has probability < 64 * 6e-7."""
    bound = 5 * np.sqrt(exact * (1 - exact) / RUNS) + 1e-12
    return bool(np.all(np.abs(freq - exact) <= bound))


def test_sampled_tokens_are_distributed_as_the_targets(monkeypatch):
    """k = 2 drafts of a different toy model; 2500 seeds; the joint distribution of the first
    three tokens against the target's, enumerated. The control: accepting every draft (no
    rejection rule) gives a distribution the same bound rejects."""
    prompt = [1, 2]
    target, draft = SharedFake(*tables(VOCAB, seed=1)), SharedFake(*tables(VOCAB, seed=5))
    exact = _exact(target, prompt)
    assert _within(_empirical(target, draft, prompt, k=2), exact)

    def accept_all(drafted, probs, logits, config, rng):
        return [*drafted, int(rng.choice(VOCAB, p=probabilities(logits, config)[-1]))]

    monkeypatch.setattr(speculative_loop, "accept_sampled", accept_all)
    assert not _within(_empirical(target, draft, prompt, k=2), exact)


def test_an_unsure_greedy_draft_stops_early():
    target = SharedFake(*tables(VOCAB, seed=1))
    w, u = tables(VOCAB, seed=2)
    flat = SharedFake(w * 0.01, u * 0.01)  # near-uniform: every draft unsure
    sure = DraftModel(flat)
    sure.start([1, 2], 32)
    assert len(sure.propose([1, 2], 4)[0]) == 4
    unsure = DraftModel(flat, min_probability=0.5)
    unsure.start([1, 2], 32)
    assert len(unsure.propose([1, 2], 4)[0]) == 1  # at least one, then it stops
    config = GenerationConfig(max_new_tokens=20)
    drafter = DraftModel(flat, min_probability=0.5)
    assert speculative_generate(target, [1, 2], drafter, config) == target.reference([1, 2], 20)
