"""Functional effect of a tokenwise approximation: patch one token's block output, measure the KL (SPEC §4.3).

For an anchor (sequence, position t, layer l) with replacement vector v = T_i(h_l), block l's output at
token t is replaced by v and the model runs on; later positions see the patch through attention (or,
for Mamba, through the recurrence). With p the clean and q the patched next-token distributions:
`kl = KL(p_t ‖ q_t)` and `kl_seq = mean_{s ≥ t} KL(p_s ‖ q_s)`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from pipeline.models.hooks import block_output, eval_mode, hooks, model_device
from pipeline.models.registry import blocks_of


def _log_probs(model: PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids, use_cache=False).logits
    return torch.log_softmax(logits.float(), dim=-1)


def _replace_at(positions: torch.Tensor, vectors: torch.Tensor):
    """A forward hook that writes `vectors[i]` into copy i of the block output at `positions[i]`."""

    def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        hidden = block_output(output).clone()
        hidden[torch.arange(len(positions), device=hidden.device), positions] = vectors.to(hidden.dtype)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook


def kl_per_position(clean: torch.Tensor, patched: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last axis from log-probabilities, summed in float64.

    Tokens with zero clean probability contribute nothing (not 0·∞). Rounding can leave values a few ulp
    below zero for identical distributions; KL is non-negative, so those are clamped.
    """
    p = clean.exp()
    terms = torch.where(p > 0, p * (clean - patched), torch.zeros_like(p))
    return terms.sum(-1, dtype=torch.float64).clamp_min(0.0)


class _CleanCache:
    """Clean log-probabilities of the sequences the current batch needs, each computed once.

    Anchors are visited sorted by sequence, so a sequence is dropped once a batch no longer needs it and
    memory stays bounded by the batch.
    """

    def __init__(self, model: PreTrainedModel, token_ids: torch.Tensor) -> None:
        self.model, self.token_ids = model, token_ids
        self.rows: dict[int, torch.Tensor] = {}

    def get(self, rows: np.ndarray) -> torch.Tensor:
        needed = [int(r) for r in np.unique(rows)]
        self.rows = {r: lp for r, lp in self.rows.items() if r in needed}
        missing = [r for r in needed if r not in self.rows]
        if missing:
            computed = _log_probs(self.model, self.token_ids[missing])
            self.rows.update(zip(missing, computed, strict=True))
        return torch.stack([self.rows[int(r)] for r in rows])


def patch_kl_anchors(
    model: PreTrainedModel,
    token_ids: np.ndarray,
    rows: np.ndarray,
    positions: np.ndarray,
    layer: int,
    vectors: np.ndarray,
    batch_size: int,
    device: torch.device | str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(kl, kl_seq) for each anchor i: sequence `token_ids[rows[i]]`, block `layer`'s output at
    `positions[i]` replaced by `vectors[i]`.

    `token_ids` is (n_seq, seq_len); `vectors` is (n, d). Patched copies are run `batch_size` at a time
    (copies of different sequences may share a batch); each sequence's clean forward runs once.
    """
    n_seq, seq_len = token_ids.shape
    n_blocks = len(blocks_of(model))
    if not 0 <= layer < n_blocks:
        raise ValueError(f"layer {layer} out of range for a model with {n_blocks} blocks")
    if not (len(rows) == len(positions) == len(vectors)):
        raise ValueError("rows, positions and vectors must have one entry per anchor")
    outside = len(rows) and (rows.min() < 0 or rows.max() >= n_seq or positions.min() < 0 or positions.max() >= seq_len)
    if outside:
        raise ValueError(f"anchor rows/positions out of range for token_ids of shape {token_ids.shape}")
    device = model_device(model) if device is None else torch.device(device)
    all_tokens = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    order = np.lexsort((positions, rows))
    kl, kl_seq = np.empty(len(rows)), np.empty(len(rows))
    with eval_mode(model), torch.inference_mode():
        clean = _CleanCache(model, all_tokens)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            chunk_rows = torch.as_tensor(rows[chunk], dtype=torch.long, device=device)
            pos = torch.as_tensor(positions[chunk], dtype=torch.long, device=device)
            vec = torch.as_tensor(vectors[chunk], device=device)
            handle = blocks_of(model)[layer].register_forward_hook(_replace_at(pos, vec))
            with hooks(handle):
                patched = _log_probs(model, all_tokens[chunk_rows])
            divergence = kl_per_position(clean.get(rows[chunk]), patched)  # (batch, seq_len)
            from_anchor = torch.arange(seq_len, device=device)[None, :] >= pos[:, None]
            kl[chunk] = divergence.gather(1, pos[:, None])[:, 0].cpu().numpy()
            kl_seq[chunk] = ((divergence * from_anchor).sum(1) / from_anchor.sum(1)).cpu().numpy()
    return kl, kl_seq
