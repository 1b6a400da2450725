"""The n-gram baselines of Study B's trained regime (`lmgeo.study_b.ngram`), against independent
computations written here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmgeo.study_b import ngram
from lmgeo.study_b.train import Windows


def test_the_bigram_is_interpolated_kneser_ney_counted_by_hand() -> None:
    """On a tiny corpus, every P(w | v) from the formula evaluated with plain loops, rows summing to 1."""
    tokens = np.array([0, 1, 2, 1, 2, 3, 1, 0, 1, 2])
    vocab, discount = 5, 0.75
    got = np.exp(ngram.bigram_log_probs(tokens, vocab, discount))
    pairs = list(zip(tokens[:-1], tokens[1:], strict=True))
    follows = {w: len({v for v, x in pairs if x == w}) for w in range(vocab)}  # N₁₊(•w)
    p_cont = {w: (follows[w] + 1) / (sum(follows.values()) + vocab) for w in range(vocab)}
    for v in range(vocab):
        seen = [x for u, x in pairs if u == v]
        for w in range(vocab):
            if not seen:
                expected = p_cont[w]
            else:
                share = discount * len(set(seen)) / len(seen)
                expected = max(seen.count(w) - discount, 0) / len(seen) + share * p_cont[w]
            assert got[v, w] == pytest.approx(expected, rel=1e-12)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-12)


def test_the_unigram_is_add_one_and_the_window_loss_is_the_causal_lm_loss() -> None:
    tokens = np.array([0, 0, 1, 2, 2, 2])
    log_p = ngram.unigram_log_probs(tokens, 4)
    np.testing.assert_allclose(np.exp(log_p), np.array([3, 2, 4, 1]) / 10)
    windows = np.array([[0, 1, 2], [2, 2, 3]])
    # tokens 1.. of each window, predicted: 1, 2, 2, 3
    assert ngram.windows_loss(log_p, windows) == pytest.approx(-np.mean(log_p[[1, 2, 2, 3]]))
    bigram = np.log(np.full((4, 4), 0.25))
    bigram[0, 1] = math.log(0.9)
    assert ngram.windows_loss(bigram, windows) == pytest.approx(-(math.log(0.9) + 3 * math.log(0.25)) / 4)


def test_a_deterministic_sequence_is_learnt_by_the_bigram_and_not_by_the_unigram() -> None:
    """A planted cycle 0→1→2→3→0: the bigram's loss on fresh windows of it is far below the unigram's
    log 4, and the discount chosen on val is one of the grid's."""
    cycle = np.tile(np.arange(4), 500)
    windows = Windows(cycle, 8, torch.device("cpu")).fixed(16).numpy()
    found = {b.model: b for b in ngram.baselines(cycle, windows, windows, 4)}
    assert found["unigram"].test_loss == pytest.approx(math.log(4), rel=1e-3)
    assert found["bigram"].test_loss < 0.01
    assert any(f"discount {d:g}" in found["bigram"].smoothing for d in ngram.DISCOUNTS)
