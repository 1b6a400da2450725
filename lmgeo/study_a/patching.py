"""Functional effect of a tokenwise approximation: patch one token's block output, measure the KL (SPEC §4.3).

For an anchor (sequence, position t, layer l) with replacement vector v (`T_i(h_l)`, or a null patch), block
l's output at token t is replaced by v and the model runs on; later positions see the patch through
attention (or, for Mamba, through the recurrence). With p the clean and q the patched next-token
distributions: `kl = KL(p_t ‖ q_t)` and `kl_seq = mean_{s ≥ t} KL(p_s ‖ q_s)`.

Each sequence's clean pass runs once, for every patched copy of it (every class and every null patch), and
keeps its log-probabilities, block l's output `h_{l+1}` and the model's key/value cache. A patched copy
then recomputes only what the patch can change (`suffix`, the default): blocks `0..l−1` are skipped (they
return their input), block `l` returns the clean `h_{l+1}` with the patch written in, and blocks
`l+1..L−1` and the head run only on the positions from the anchor on, attending to the clean keys and
values of the positions before it (the model's own forward with the cache cut at the anchor, so positions,
rotary embeddings, ALiBi and masks are the family's own). The copies of a batch are split into groups that
each start at their earliest anchor (`_groups`: one forward per group, where that saves more tokens than a
forward costs).

The cached path is used only where it is checked to reproduce the full forward: the first `suffix` call at
each (model, layer) patches a probe (one of its sequences, anchors near the start, middle and end) both ways
and compares the KLs (`suffix_path` says which path was chosen, and why). Where they differ or the cached
path fails (the recurrent families mamba, mamba2 and falcon_mamba: transformers' multi-token forward, like
mamba-ssm's scan kernel, starts from a zero state and ignores a cached one, so only a one-token-at-a-time
continuation could start at the anchor, and that is seldom faster than the whole sequence: for the last 16–48 of
64 tokens it took 2–4× the full forward at d = 64 and 0.9–2.8× at d = 768 on one CPU thread),
`suffix` runs as `recompute` does: blocks `l+1..` on every position, the head from the batch's earliest
anchor on. `full` runs the whole model with a hook on block l's output instead, the straightforward
reference.

A recurrent family's copies that stop at their anchor (the null copies, nine in ten) need one position only:
their state before the anchor is the clean one. There `suffix` takes the `stepped` path where the probe
confirms it: the clean sequences run one token at a time with the family's recurrent cache, its state
before each anchor is kept, and every such copy is one step of blocks `l+1..` from that state, compared with
the clean step's distribution (`_stepped_kl`); copies that run to the end are recomputed as above.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from lmgeo.models.hooks import block_input, block_output, eval_mode, hooks, model_device
from lmgeo.models.registry import blocks_of
from lmgeo.study_a.verify import TOLERANCE

Mode = Literal["suffix", "recompute", "full"]  # `suffix` may run as `cached`, `stepped` or `recompute`
# What one more forward costs, in copy-positions of blocks and head (a tiny model's fixed per-forward cost on
# a CPU; for a large model it is an overestimate, which only merges a few more anchors into one forward).
FORWARD_COST = 64
_PATHS: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[str, str]]] = weakref.WeakKeyDictionary()


def kl_per_position(clean: torch.Tensor, patched: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) over the last axis from log-probabilities, summed in float64.

    Tokens with zero clean probability contribute nothing (not 0·∞). Rounding can leave values a few ulp
    below zero for identical distributions; KL is non-negative, so those are clamped.
    """
    p = clean.exp()
    terms = torch.where(p > 0, p * (clean - patched), torch.zeros_like(p))
    return terms.sum(-1, dtype=torch.float64).clamp_min(0.0)


def _log_probs(
    model: PreTrainedModel, input_ids: torch.Tensor, keep: int = 0, cache: DynamicCache | None = None
) -> torch.Tensor:
    """Log-probabilities of the last `keep` positions (all when 0); with `cache`, the model continues from
    the positions it holds (and appends the new ones to it)."""
    kwargs: dict[str, Any] = {"use_cache": False} if cache is None else {"cache": cache, "use_cache": True}
    if keep and "logits_to_keep" in inspect.signature(model.forward).parameters:
        logits = model(input_ids=input_ids, logits_to_keep=keep, **kwargs).logits
    else:
        logits = model(input_ids=input_ids, **kwargs).logits
        logits = logits[:, -keep:] if keep else logits
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass(frozen=True)
class _Clean:
    """A group of patched copies' clean passes, one row per copy, from the group's first position `start`."""

    log_probs: torch.Tensor  # (b, T − start, V)
    hidden: torch.Tensor  # h_{l+1}, (b, T, d)
    keys_values: list[tuple[torch.Tensor, torch.Tensor] | None] | None  # per block, cut at `start`; None: no cache


class _CleanCache:
    """Clean log-probabilities, block `layer`'s output and (`with_cache`) the key/value cache of the sequences
    the current batch needs, each computed once. Anchors are visited sorted by sequence, so a sequence is
    dropped once a batch no longer needs it and memory stays bounded by the batch."""

    def __init__(self, model: PreTrainedModel, token_ids: torch.Tensor, layer: int, with_cache: bool) -> None:
        self.model, self.token_ids, self.layer, self.with_cache = model, token_ids, layer, with_cache
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor] | None]]] = {}
        self.output_is_tensor = True

    def load(self, rows: np.ndarray) -> None:
        """Keep exactly the sequences of `rows`, computing those not yet held."""
        needed = [int(r) for r in np.unique(rows)]
        self.rows = {r: v for r, v in self.rows.items() if r in needed}
        missing = [r for r in needed if r not in self.rows]
        if not missing:
            return
        captured: list[torch.Tensor] = []

        def keep_output(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            self.output_is_tensor = isinstance(output, torch.Tensor)
            captured.append(block_output(output))

        # A cache without the config: every block keeps all its keys and values (a sliding-window block's
        # cache would keep only the last window, which cannot be cut at an earlier position).
        cache = DynamicCache() if self.with_cache else None
        with hooks(blocks_of(self.model)[self.layer].register_forward_hook(keep_output)):
            log_probs = _log_probs(self.model, self.token_ids[missing], cache=cache)
        kept = self._kept(cache)
        for i, row in enumerate(missing):
            per_block = [None if kv is None else (kv[0][i], kv[1][i]) for kv in kept]
            self.rows[row] = (log_probs[i], captured[0][i], per_block)

    def _kept(self, cache: DynamicCache | None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """The blocks' (keys, values) a patched copy needs: those of blocks `layer+1..` (attended to) and of
        block 0 (the model reads the number of cached positions from it, for positions and masks)."""
        if cache is None:
            return []
        return [(c.keys, c.values) if i == 0 or i > self.layer else None for i, c in enumerate(cache.layers)]  # type: ignore[misc, union-attr]  # attention caches

    def select(self, rows: np.ndarray, start: int) -> _Clean:
        log_probs, hidden, per_block = zip(*(self.rows[int(r)] for r in rows), strict=True)
        keys_values = _cut(per_block, start) if self.with_cache else None
        return _Clean(torch.stack(log_probs)[:, start:], torch.stack(hidden), keys_values)


def _cut(
    per_row: tuple[list[tuple[torch.Tensor, torch.Tensor] | None], ...], start: int
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Each block's (keys, values) of positions before `start`, stacked over the rows (None where not kept)."""
    return [
        None if kept is None else tuple(torch.stack([row[block][j][..., :start, :] for row in per_row]) for j in (0, 1))  # type: ignore[misc, index]
        for block, kept in enumerate(per_row[0])
    ]


def suffix_path(model: PreTrainedModel, layer: int) -> tuple[str, str] | None:
    """How `suffix` patches block `layer` of `model`, `cached` or `recompute`, and why; None before the
    first `suffix` call at that layer."""
    return _PATHS.get(model, {}).get(layer)


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
    to_end: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(kl, kl_seq) for each patched copy i: sequence `token_ids[rows[i]]`, block `layer`'s output at
    `positions[i]` replaced by `vectors[i]`.

    `token_ids` is (n_seq, seq_len); `vectors` is (n, d). Copies are run `batch_size` at a time, sorted by
    (sequence, position) so that the copies of one anchor share a batch; each sequence's clean forward runs
    once for all its copies. `mode` as in the module docstring (the KLs agree to float rounding). `to_end`
    (n,) bool, default all: False for a copy whose `kl` alone is wanted; the model is causal, so its forward
    stops at its anchor (its `kl_seq` is NaN).
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
    tokens = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    to_end = np.ones(len(rows), dtype=bool) if to_end is None else np.asarray(to_end, dtype=bool)
    with eval_mode(model), torch.inference_mode():
        path = _checked_path(model, tokens[rows[:1]], layer, vectors) if mode == "suffix" and len(rows) else mode
        stops = np.where(to_end, seq_len, positions + 1)
        kl, kl_seq = _patch_kl(model, tokens, rows, positions, stops, layer, vectors, batch_size, path)
    return kl, np.where(to_end, kl_seq, np.nan)


def _patch_kl(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    rows: np.ndarray,
    positions: np.ndarray,
    stops: np.ndarray,
    layer: int,
    vectors: np.ndarray,
    batch_size: int,
    path: str,
) -> tuple[np.ndarray, np.ndarray]:
    """`patch_kl_anchors` on checked arguments, by `path`: `cached`, `recompute` or `full`; copy i's
    forward runs up to position `stops[i]` (exclusive), its `kl_seq` over the positions before it."""
    if path == "stepped":  # the copies that stop at their anchor by one recurrent step, the others recomputed
        kl, kl_seq, at_anchor = np.empty(len(rows)), np.empty(len(rows)), stops == positions + 1
        kl[at_anchor] = kl_seq[at_anchor] = _stepped_kl(
            model, tokens, rows[at_anchor], positions[at_anchor], layer, vectors[at_anchor], batch_size
        )
        rest = ~at_anchor
        kl[rest], kl_seq[rest] = _patch_kl(
            model, tokens, rows[rest], positions[rest], stops[rest], layer, vectors[rest], batch_size, "recompute"
        )
        return kl, kl_seq
    device = tokens.device
    order = np.lexsort((positions, rows))
    kl, kl_seq = np.empty(len(rows)), np.empty(len(rows))
    clean = _CleanCache(model, tokens, layer, with_cache=path == "cached")
    for begin in range(0, len(order), batch_size):
        chunk = order[begin : begin + batch_size]
        clean.load(rows[chunk])
        for group in _chunk_groups(positions[chunk], stops[chunk], path):
            copies = chunk[group]
            pos = torch.as_tensor(positions[copies], dtype=torch.long, device=device)
            start, stop = int(pos.min()), int(stops[copies].max())
            batch = clean.select(rows[copies], start)
            vec = torch.as_tensor(vectors[copies], device=device)
            row_tokens = tokens[torch.as_tensor(rows[copies], dtype=torch.long, device=device)][:, :stop]
            if path != "full" and clean.output_is_tensor:
                hidden = _written(batch.hidden[:, :stop], pos, vec)
                patched = _suffix_log_probs(model, layer, row_tokens, hidden, start, batch.keys_values)
            else:
                with hooks(blocks_of(model)[layer].register_forward_hook(_replace_at(pos, vec))):
                    patched = _log_probs(model, row_tokens, stop - start)
            divergence = kl_per_position(batch.log_probs[:, : stop - start], patched)  # (copies, stop − start)
            offset = pos - start
            from_anchor = torch.arange(stop - start, device=device)[None, :] >= offset[:, None]
            kl[copies] = divergence.gather(1, offset[:, None])[:, 0].cpu().numpy()
            kl_seq[copies] = ((divergence * from_anchor).sum(1) / from_anchor.sum(1)).cpu().numpy()
    return kl, kl_seq


def _chunk_groups(positions: np.ndarray, stops: np.ndarray, path: str) -> list[np.ndarray]:
    """How a batch's copies are split into forwards. The cached path runs positions `start..stop` of a
    group; `recompute` runs `0..stop` (a recurrent state cannot be cut), so its groups gather copies of
    similar stops; `full`, the reference, runs the batch as one forward."""
    if path == "full":
        return [np.arange(len(positions))]
    return _groups(positions if path == "cached" else np.zeros_like(positions), stops)


def _groups(positions: np.ndarray, stops: np.ndarray) -> list[np.ndarray]:
    """Indices of `positions` split into groups, each run as one forward from its earliest position to its
    latest stop: in order of position (then stop), the split minimising the sum over groups of
    `FORWARD_COST + copies × (stop − start)`."""
    order = np.lexsort((stops, positions))
    starts, ends = positions[order], stops[order]
    best, first = np.zeros(len(order) + 1), np.zeros(len(order) + 1, dtype=int)
    for end in range(1, len(order) + 1):
        reach = np.maximum.accumulate(ends[:end][::-1])[::-1]  # the latest stop of copies i..end−1
        costs = best[:end] + FORWARD_COST + (end - np.arange(end)) * (reach - starts[:end])
        first[end] = int(np.argmin(costs))
        best[end] = costs[first[end]]
    groups, end = [], len(order)
    while end:
        groups.append(order[first[end] : end])
        end = first[end]
    return groups[::-1]


def _checked_path(model: PreTrainedModel, tokens: torch.Tensor, layer: int, vectors: np.ndarray) -> str:
    known = _PATHS.setdefault(model, {})
    if layer not in known:
        known[layer] = _probe(model, tokens, layer, vectors)
    return known[layer][0]


def _probe(model: PreTrainedModel, tokens: torch.Tensor, layer: int, vectors: np.ndarray) -> tuple[str, str]:
    """Patch the sequence `tokens` (1, T) near its start, middle and end, each copy from its own position,
    with the cached path and with the full forward: the cached path is used when their KLs agree to the
    tolerance of the model's dtype. The vectors are the call's own (of the layer's scale) moved in a seeded
    random direction, so that no probe patch is the clean output itself (a KL at rounding level)."""
    seq_len = tokens.shape[1]
    positions = np.unique(np.minimum([1, seq_len // 2, seq_len - 1], seq_len - 1))
    rows, probe_vectors = np.zeros(len(positions), dtype=int), vectors[np.arange(len(positions)) % len(vectors)]
    noise = np.random.default_rng(0).normal(size=probe_vectors.shape)
    probe_vectors = (probe_vectors + noise * np.abs(probe_vectors).mean()).astype(probe_vectors.dtype)
    tolerance = TOLERANCE.get(next(model.parameters()).dtype, 1e-4)
    to_end = np.full(len(positions), seq_len)
    cached = _agreement(model, tokens, rows, positions, to_end, layer, probe_vectors, "cached", tolerance)
    if cached[0]:
        return "cached", cached[1]
    # A recurrent state cannot be cut at the anchor; one step from it may still give the copies that stop there.
    stepped = _agreement(model, tokens, rows, positions, positions + 1, layer, probe_vectors, "stepped", tolerance)
    return ("stepped", f"{cached[1]}; one recurrent step: {stepped[1]}") if stepped[0] else ("recompute", cached[1])


def _agreement(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    rows: np.ndarray,
    positions: np.ndarray,
    stops: np.ndarray,
    layer: int,
    vectors: np.ndarray,
    path: str,
    tolerance: float,
) -> tuple[bool, str]:
    """Whether `path` gives the full forward's KLs for these copies to `tolerance` (relative), and why."""
    try:
        got = _patch_kl(model, tokens, rows, positions, stops, layer, vectors, 1, path)
    except Exception as err:  # noqa: BLE001 - a family whose cache cannot be used this way
        return False, f"the {path} path failed: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    want = _patch_kl(model, tokens, rows, positions, stops, layer, vectors, 1, "full")
    scale = max(float(np.max(want[0])), float(np.max(want[1])), np.finfo(np.float64).tiny)
    error = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want, strict=True)) / scale
    verb = "agree with" if error <= tolerance else "differ from"
    return error <= tolerance, f"the probe's KLs {verb} the full forward's to {error:.1e} (relative)"


def _stepped_kl(
    model: PreTrainedModel,
    tokens: torch.Tensor,
    rows: np.ndarray,
    positions: np.ndarray,
    layer: int,
    vectors: np.ndarray,
    batch_size: int,
) -> np.ndarray:
    """`kl` of copies that stop at their anchor, for a model with a recurrent cache: block `layer`'s output at
    the anchor replaced, blocks `layer+1..` and the head run one step from the clean states before the anchor,
    against the clean step's distribution. Copies at position 0 start from no state, as the clean pass does."""
    kl = np.empty(len(rows))
    if not len(rows):
        return kl
    states, clean = _clean_steps(model, tokens, rows, positions, layer)
    order = np.lexsort((positions, rows))
    for begin in range(0, len(order), batch_size):
        chunk = order[begin : begin + batch_size]
        for first in (True, False):  # position 0 (no state yet) and later positions run apart
            copies = chunk[(positions[chunk] == 0) == first]
            if not len(copies):
                continue
            keys = list(zip(rows[copies].tolist(), positions[copies].tolist(), strict=True))
            cache = None if first else _cache_of(model, [states[key] for key in keys])
            step = tokens[torch.as_tensor(rows[copies]), torch.as_tensor(positions[copies])][:, None]
            patched = torch.as_tensor(vectors[copies], device=tokens.device)[:, None, :]
            replaced = {**{i: _pass_through for i in range(layer)}, layer: lambda *a, v=patched, **kw: v}
            with _forwards(replaced, blocks_of(model)):
                logits = model(input_ids=step, cache=cache, use_cache=cache is not None).logits[:, -1]
            q = torch.log_softmax(logits.float(), dim=-1)
            kl[copies] = kl_per_position(torch.stack([clean[key] for key in keys]), q).cpu().numpy()
    return kl


# One cached block's recurrent state: its conv and recurrent states, each by state index.
_BlockState = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]


def _clean_steps(
    model: PreTrainedModel, tokens: torch.Tensor, rows: np.ndarray, positions: np.ndarray, layer: int
) -> tuple[dict[tuple[int, int], list[_BlockState]], dict[tuple[int, int], torch.Tensor]]:
    """The clean sequences of `rows`, one token at a time with the model's cache: for each (row, position) of
    an anchor, the states of blocks `layer+1..` before it and the clean log-probabilities at it."""
    needed = sorted(set(zip(rows.tolist(), positions.tolist(), strict=True)))
    sequences = sorted({row for row, _ in needed})
    index_of = {row: i for i, row in enumerate(sequences)}
    ids = tokens[torch.as_tensor(sequences)]
    cache, states, clean = None, {}, {}
    for t in range(max(pos for _, pos in needed) + 1):
        for row, pos in needed:  # the state after positions 0..t−1 is the one before an anchor at t
            if pos == t and t > 0:
                states[(row, pos)] = _block_states(cache, index_of[row], layer)
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.cache_params
        log_probs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        for row, pos in needed:
            if pos == t:
                clean[(row, pos)] = log_probs[index_of[row]]
    return states, clean


def _block_states(cache: Any, row: int, layer: int) -> list[_BlockState]:
    """Copies of one sequence's conv and recurrent states in the blocks after `layer`."""
    return [
        (
            {i: c[row].clone() for i, c in block.conv_states.items() if c is not None},
            {i: r[row].clone() for i, r in block.recurrent_states.items() if r is not None},
        )
        for block in cache.layers[layer + 1 :]
    ]


def _cache_of(model: PreTrainedModel, per_copy: list[list[_BlockState]]) -> DynamicCache:
    """A fresh cache holding, row by row, the given copies' states in the blocks after the patched one (the
    blocks up to it are bypassed, so their entries are never read)."""
    cache = DynamicCache(config=model.config)
    first = len(cache.layers) - len(per_copy[0])
    for offset, block in enumerate(cache.layers[first:]):
        conv, recurrent = per_copy[0][offset]
        for which, (kind, states) in enumerate((("conv_states", conv), ("recurrent_states", recurrent))):
            for i in states:
                getattr(block, kind)[i] = torch.stack([copy[offset][which][i] for copy in per_copy])
        for i in conv:
            block.conv_kernel_size[i] = conv[i].shape[-1]  # type: ignore[union-attr]  # a linear-attention layer
            block.is_conv_states_initialized[i] = True  # type: ignore[union-attr]  # a linear-attention layer
        for i in recurrent:
            block.is_recurrent_states_initialized[i] = True  # type: ignore[union-attr]  # a linear-attention layer
        for i in {*conv, *recurrent}:
            block.has_previous_state[i] = True  # type: ignore[union-attr]  # a linear-attention layer
    return cache


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


def _suffix_log_probs(
    model: PreTrainedModel,
    layer: int,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    start: int,
    keys_values: list[tuple[torch.Tensor, torch.Tensor] | None] | None,
) -> torch.Tensor:
    """The model's log-probabilities (positions `start..`) when block `layer` outputs `hidden`, computing
    blocks `layer+1..` and the head only: the blocks before return their input, block `layer` `hidden`. With
    the clean `keys_values` (cut at `start`), only positions `start..` run; without, every position does."""
    keep, cache = tokens.shape[1] - start, None
    if keys_values is not None:
        tokens, hidden = tokens[:, start:], hidden[:, start:]
        # The batch's own cache, from copies of the clean tensors: the forward appends to it.
        cache = DynamicCache(ddp_cache_data=[(None, None) if kv is None else kv for kv in keys_values])
    blocks = blocks_of(model)
    with _forwards({**{i: _pass_through for i in range(layer)}, layer: lambda *a, **kw: hidden}, blocks):
        return _log_probs(model, tokens, keep, cache)


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
