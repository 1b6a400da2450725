"""Functional effect of a tokenwise approximation: patch one token's block output, measure the KL (SPEC §4.3).

For an anchor (sequence, position t, layer l) with replacement vector v (`T_i(h_l)`, or a null patch), block
l's output at token t is replaced by v and the model runs on; later positions see the patch through
attention (or, for Mamba, through the recurrence). With p the clean and q the patched next-token
distributions: `kl = KL(p_t ‖ q_t)` and `kl_seq = mean_{s ≥ t} KL(p_s ‖ q_s)`.

Each sequence's clean pass runs once, for every patched copy of it (every class and every null patch), and
keeps its log-probabilities and block l's output `h_{l+1}`. A patched copy then recomputes only what the
patch can change (`suffix`, the default): blocks `0..l−1` are skipped (they return their input), block
`l` returns the clean `h_{l+1}` with the patch written in, blocks `l+1..L−1` run, and the head runs only on
the positions from the earliest anchor of the batch on (`logits_to_keep`; positions before an anchor
cannot change in a causal model). Positions before the anchor are still recomputed inside blocks `l+1..`:
skipping them needs each family's key/value cache or recurrent state, which this does not use. `full`
runs the whole model with a hook on block l's output instead, the straightforward reference.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

from pipeline.models.hooks import block_input, block_output, eval_mode, hooks, model_device
from pipeline.models.registry import blocks_of

Mode = Literal["suffix", "full"]


def kl_per_position(clean: torch.Tensor, patched: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last axis from log-probabilities, summed in float64.

    Tokens with zero clean probability contribute nothing (not 0·∞). Rounding can leave values a few ulp
    below zero for identical distributions; KL is non-negative, so those are clamped.
    """
    p = clean.exp()
    terms = torch.where(p > 0, p * (clean - patched), torch.zeros_like(p))
    return terms.sum(-1, dtype=torch.float64).clamp_min(0.0)


def _log_probs(model: PreTrainedModel, input_ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
    """Log-probabilities of the last `keep` positions (all when 0)."""
    if keep and "logits_to_keep" in inspect.signature(model.forward).parameters:
        logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep).logits
    else:
        logits = model(input_ids=input_ids, use_cache=False).logits
        logits = logits[:, -keep:] if keep else logits
    return torch.log_softmax(logits.float(), dim=-1)


class _CleanCache:
    """Clean log-probabilities and block `layer`'s output of the sequences the current batch needs, each
    computed once. Anchors are visited sorted by sequence, so a sequence is dropped once a batch no longer
    needs it and memory stays bounded by the batch."""

    def __init__(self, model: PreTrainedModel, token_ids: torch.Tensor, layer: int) -> None:
        self.model, self.token_ids, self.layer = model, token_ids, layer
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.output_is_tensor = True

    def get(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities (b, T, V), h_{l+1} (b, T, d)) of each row's sequence."""
        needed = [int(r) for r in np.unique(rows)]
        self.rows = {r: v for r, v in self.rows.items() if r in needed}
        missing = [r for r in needed if r not in self.rows]
        if missing:
            captured: list[torch.Tensor] = []

            def keep_output(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
                self.output_is_tensor = isinstance(output, torch.Tensor)
                captured.append(block_output(output))

            with hooks(blocks_of(self.model)[self.layer].register_forward_hook(keep_output)):
                log_probs = _log_probs(self.model, self.token_ids[missing])
            self.rows.update(zip(missing, zip(log_probs, captured[0], strict=True), strict=True))
        log_probs, hidden = zip(*(self.rows[int(r)] for r in rows), strict=True)
        return torch.stack(log_probs), torch.stack(hidden)


def patch_kl_anchors(
    model: PreTrainedModel,
    token_ids: np.ndarray,
    rows: np.ndarray,
    positions: np.ndarray,
    layer: int,
    vectors: np.ndarray,
    batch_size: int,
    device: torch.device | str | None = None,
    mode: Mode = "suffix",
) -> tuple[np.ndarray, np.ndarray]:
    """(kl, kl_seq) for each patched copy i: sequence `token_ids[rows[i]]`, block `layer`'s output at
    `positions[i]` replaced by `vectors[i]`.

    `token_ids` is (n_seq, seq_len); `vectors` is (n, d). Copies are run `batch_size` at a time, sorted by
    (sequence, position) so that the copies of one anchor share a batch; each sequence's clean forward runs
    once for all its copies. `mode` as in the module docstring (the KLs agree to float rounding).
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
        clean = _CleanCache(model, all_tokens, layer)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            pos = torch.as_tensor(positions[chunk], dtype=torch.long, device=device)
            vec = torch.as_tensor(vectors[chunk], device=device)
            clean_lp, clean_h = clean.get(rows[chunk])
            keep = seq_len - int(pos.min())
            tokens = all_tokens[torch.as_tensor(rows[chunk], dtype=torch.long, device=device)]
            if mode == "suffix" and clean.output_is_tensor:
                patched = _suffix_log_probs(model, layer, tokens, _written(clean_h, pos, vec), keep)
            else:
                with hooks(blocks_of(model)[layer].register_forward_hook(_replace_at(pos, vec))):
                    patched = _log_probs(model, tokens, keep)
            divergence = kl_per_position(clean_lp[:, seq_len - keep :], patched)  # (batch, keep)
            offset = pos - (seq_len - keep)
            from_anchor = torch.arange(keep, device=device)[None, :] >= offset[:, None]
            kl[chunk] = divergence.gather(1, offset[:, None])[:, 0].cpu().numpy()
            kl_seq[chunk] = ((divergence * from_anchor).sum(1) / from_anchor.sum(1)).cpu().numpy()
    return kl, kl_seq


def _written(hidden: torch.Tensor, positions: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """`hidden` (b, T, d) with `vectors[i]` written at `positions[i]` of copy i."""
    out = hidden.clone()
    out[torch.arange(len(positions), device=out.device), positions] = vectors.to(out.dtype)
    return out


def _replace_at(positions: torch.Tensor, vectors: torch.Tensor) -> Callable[..., Any]:
    """A forward hook that writes `vectors[i]` into copy i of the block output at `positions[i]`."""

    def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        hidden = _written(block_output(output), positions, vectors)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook


def _suffix_log_probs(model: PreTrainedModel, layer: int, tokens: torch.Tensor, hidden: torch.Tensor, keep: int) -> torch.Tensor:
    """The model's log-probabilities (last `keep` positions) when block `layer` outputs `hidden`, computing
    blocks `layer+1..` and the head only: the blocks before return their input, block `layer` `hidden`."""
    blocks = blocks_of(model)
    with _forwards({**{i: _pass_through for i in range(layer)}, layer: lambda *a, **kw: hidden}, blocks):
        return _log_probs(model, tokens, keep)


def _pass_through(*args: Any, **kwargs: Any) -> torch.Tensor:
    return block_input(args, kwargs)


@contextmanager
def _forwards(replacements: dict[int, Callable[..., Any]], blocks: nn.ModuleList) -> Iterator[None]:
    """Blocks' `forward` replaced for the duration (an instance attribute shadows the method), restored
    however the forward ends."""
    try:
        for i, forward in replacements.items():
            blocks[i].forward = forward
        yield
    finally:
        for i in replacements:
            blocks[i].__dict__.pop("forward", None)
