"""The n-gram baselines Study B's models must beat (SPEC §3.2, "trained regime"): a unigram and an
interpolated Kneser–Ney bigram, counted on the train split, the bigram's discount chosen on val, both
evaluated exactly as the models' final losses are: on the same fixed windows
(`lmgeo.study_b.train.Windows.fixed`), each window's tokens 1..L−1 predicted from the ones before, the
mean over every predicted token (the causal LM loss).

A model that does not beat the bigram has learnt less than the previous token tells; a comparison of
optimizers there says little about trained models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DISCOUNTS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 0.95)  # the bigram's discount grid, chosen on val


@dataclass(frozen=True)
class NgramLoss:
    model: str  # "unigram" or "bigram"
    smoothing: str  # what the probabilities are, in words
    val_loss: float
    test_loss: float


def unigram_log_probs(train: np.ndarray, vocab: int) -> np.ndarray:
    """log P(w), add-one smoothed counts of the train split (every token has a finite probability)."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    return np.log(counts / counts.sum())


def bigram_log_probs(train: np.ndarray, vocab: int, discount: float) -> np.ndarray:
    """(V, V) log P(w | v), interpolated Kneser–Ney on the train split's bigrams:
    `P(w|v) = max(c(v,w) − D, 0)/c(v) + D·N₁₊(v•)/c(v) · P_cont(w)`, with `P_cont(w) ∝ N₁₊(•w) + 1` (the number
    of distinct tokens w follows, add-one so that no token is impossible); a context never seen takes
    `P_cont`. Each row sums to 1."""
    if not 0 < discount < 1:
        raise ValueError(f"the Kneser–Ney discount must be in (0, 1), got {discount}")
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    continuation = (counts > 0).sum(axis=0) + 1.0
    p_cont = continuation / continuation.sum()
    context = counts.sum(axis=1, keepdims=True)
    seen = context > 0
    safe = np.where(seen, context, 1.0)
    weight = np.where(seen, discount * (counts > 0).sum(axis=1, keepdims=True) / safe, 1.0)
    probs = np.maximum(counts - discount, 0.0) / safe + weight * p_cont[None, :]
    return np.log(probs)


def windows_loss(log_probs: np.ndarray, windows: np.ndarray) -> float:
    """Mean cross-entropy of predicting each window's tokens 1..L−1: `log_probs` is (V,) for a unigram or
    (V, V) for a bigram (row: the previous token)."""
    previous, target = windows[:, :-1].ravel(), windows[:, 1:].ravel()
    chosen = log_probs[target] if log_probs.ndim == 1 else log_probs[previous, target]
    return float(-chosen.mean())


def baselines(train: np.ndarray, val_windows: np.ndarray, test_windows: np.ndarray, vocab: int) -> list[NgramLoss]:
    """The unigram and the bigram (its discount the best on `val_windows`), on val and test."""
    unigram = unigram_log_probs(train, vocab)
    by_discount = {d: bigram_log_probs(train, vocab, d) for d in DISCOUNTS}
    best = min(DISCOUNTS, key=lambda d: (windows_loss(by_discount[d], val_windows), d))
    bigram = by_discount[best]
    return [
        NgramLoss(
            "unigram",
            "train-split counts, add-one",
            windows_loss(unigram, val_windows),
            windows_loss(unigram, test_windows),
        ),
        NgramLoss(
            "bigram",
            f"interpolated Kneser–Ney on the train split, discount {best:g} (chosen on val)",
            windows_loss(bigram, val_windows),
            windows_loss(bigram, test_windows),
        ),
    ]
