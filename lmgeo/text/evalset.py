"""The eval sequences of Study A: complete windows of `seq_len` tokens, so any sequence can be replayed."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lmgeo.core.errors import InputError


def eval_windows(tokens: np.ndarray, n_sequences: int, seq_len: int) -> np.ndarray:
    """The first `n_sequences` non-overlapping windows of the stream, shape (n_sequences, seq_len)."""
    needed = n_sequences * seq_len
    if len(tokens) < needed:
        raise InputError(
            f"analysis.eval_sequences={n_sequences} of {seq_len} tokens needs {needed} eval tokens, "
            f"but the val split has {len(tokens)}; lower eval_sequences or raise prepare.val_fraction"
        )
    return np.ascontiguousarray(tokens[:needed].reshape(n_sequences, seq_len), dtype=np.int32)


# A tokenizer of another model may need up to this many times our tokens for the same text.
RETOKENIZE_SLACK = 4


def retokenize(
    tokens: np.ndarray,
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
    n_sequences: int,
    seq_len: int,
) -> np.ndarray:
    """Eval windows for a model with its own tokenizer: the text of our leading eval tokens (`decode`),
    encoded by its tokenizer (`encode`), cut into windows as `eval_windows` does."""
    text = decode(tokens[: RETOKENIZE_SLACK * n_sequences * seq_len].tolist())
    return eval_windows(np.asarray(encode(text), dtype=np.int32), n_sequences, seq_len)
