"""Synthetic inputs: layer states with a known map plus noise, token ids, activation batches."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def synthetic_states(n_seq: int, seq_len: int, d: int, n_layers: int, seed: int) -> np.ndarray:
    """`(n_layers + 1, n_seq·seq_len, d)` float32 residual streams: each layer adds a nonlinear
    tokenwise update and a cross-token one (the sequence mean), like the layers Study A fits."""
    rng = np.random.default_rng(seed)
    n = n_seq * seq_len
    h = rng.normal(size=(n, d)) + 0.5
    states = [h]
    for _ in range(n_layers):
        mix, context = rng.normal(size=(d, d)) / math.sqrt(d), rng.normal(size=(d, d)) / math.sqrt(d)
        seq_mean = h.reshape(n_seq, seq_len, d).mean(axis=1).repeat(seq_len, axis=0)
        h = h + 0.5 * np.tanh(h @ mix) + 0.3 * seq_mean @ context
        states.append(h)
    return np.stack(states).astype(np.float32)


def token_ids(n_seq: int, seq_len: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(n_seq, seq_len))


def activation_batch(states: np.ndarray, seq_len: int, tokens: np.ndarray) -> list[Any]:
    """One Arrow record batch per layer in the activation schema (SPEC §4.1) for synthetic `states`."""
    import pyarrow as pa

    from lmgeo.core.contracts import vectors_to_arrow
    from lmgeo.study_a.extract import ACTIVATION_COLUMNS

    n = states.shape[1]
    ids = [
        pa.array(np.repeat(np.arange(n // seq_len, dtype=np.int32), seq_len)),
        pa.array(np.tile(np.arange(seq_len, dtype=np.int32), n // seq_len)),
        pa.array(tokens.reshape(-1).astype(np.int32)),
    ]
    return [pa.RecordBatch.from_arrays([*ids, vectors_to_arrow(h)], names=list(ACTIVATION_COLUMNS)) for h in states]
