"""The perturbation of one layer transition (SPEC §4.3, §4.5): for every fitted anchor of every class, the
KL of the next-token distribution when block l's output at the anchor's token is replaced by the fitted
`T_i(h_l)` (`kl`, `kl_seq`), and by the null patches of `lmgeo.study_a.nulls` (`kl_directions`, the KL of
each of `n_random` random directions, `kl_random` their mean, and `kl_other`).

The sequences are replayed from the stored activations (layer 0 holds every token id); `h_{l+1}` at the
anchors is the clean output the null patches are measured from. Every patched copy of every class goes
through one `patch_kl_anchors` call, so each sequence's clean pass runs once for all of them; a null copy
needs only its `kl`, so its forward stops at its anchor. An anchor without a patch (its value not
identified) gets null KLs; `kl_other` is null for every anchor of a class with fewer than two patches.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import PreTrainedModel

from lmgeo.core.contracts import PERTURB, arrow_to_vectors
from lmgeo.study_a.nulls import null_patches
from lmgeo.study_a.patching import patch_kl_anchors


class _Copies(NamedTuple):
    """Patched copies of one kind (real, random, other) of one class: their anchors and vectors."""

    rows: np.ndarray
    pos: np.ndarray
    vectors: np.ndarray
    to_end: bool  # kl_seq wanted (the real patch), or kl alone (a null patch)


def perturb_layer(
    model: PreTrainedModel,
    tokens_rows: pa.Table,
    outputs: pa.Table,
    fits: dict[str, pa.Table],
    layer: int,
    seed: int,
    batch_size: int,
    directions: int,
) -> dict[str, pa.Table]:
    """One `PERTURB` table per class of `fits`, in its order.

    `tokens_rows`: the activations of layer 0 (`seq_id`, `token_id`), every token of every sequence;
    `outputs`: those of layer `layer + 1` (`seq_id`, `pos`, `h`); `fits[fn]`: the class's fit rows
    (`sample`, `seq_id`, `pos`, `patched`), of which the `real` sample's anchors are patched, each by its fit
    and by `directions` random directions and another anchor's residual. Class number `index` (its place in
    `fits`) draws its null patches from `default_rng([seed, layer, index])`.
    """
    sequences = np.unique(tokens_rows["seq_id"].to_numpy())
    seq_len = len(tokens_rows) // len(sequences)
    tokens = tokens_rows["token_id"].to_numpy().astype(np.int64).reshape(len(sequences), seq_len)
    h_next = arrow_to_vectors(outputs["h"]).reshape(len(sequences), seq_len, -1)
    kinds: list[tuple[str, str, _Copies]] = []  # (class, column, copies)
    reals = {}
    for index, (fn, rows_of_class) in enumerate(fits.items()):
        real = rows_of_class.filter(pc.equal(rows_of_class["sample"], "real"))
        rows = np.searchsorted(sequences, real["seq_id"].to_numpy())
        pos = real["pos"].to_numpy()
        patches = null_patches(
            real["patched"], h_next[rows, pos], np.random.default_rng([seed, layer, index]), directions
        )
        rows, pos = rows[patches.valid], pos[patches.valid]
        reals[fn] = (real, patches.valid)
        kinds.append((fn, "kl", _Copies(rows, pos, patches.real, True)))
        kinds.append(
            (
                fn,
                "kl_random",
                _Copies(
                    np.repeat(rows, directions),
                    np.repeat(pos, directions),
                    patches.random.reshape(-1, patches.random.shape[-1]),
                    False,
                ),
            )
        )
        if patches.other is not None:
            kinds.append((fn, "kl_other", _Copies(rows, pos, patches.other, False)))
    every = [copies for _, _, copies in kinds]
    rows, pos, vectors = (np.concatenate([getattr(c, name) for c in every]) for name in ("rows", "pos", "vectors"))
    to_end = np.concatenate([np.full(len(c.rows), c.to_end) for c in every])
    kl, kl_seq = patch_kl_anchors(model, tokens, rows, pos, layer, vectors, batch_size, to_end=to_end)
    values: dict[str, dict[str, np.ndarray]] = {fn: {} for fn in fits}
    start = 0
    for fn, column, copies in kinds:
        part = slice(start, start + len(copies.rows))
        start = part.stop
        if column == "kl_random":  # each direction's KL, and their mean
            values[fn]["kl_directions"] = kl[part].reshape(-1, directions)
            values[fn][column] = values[fn]["kl_directions"].mean(axis=1)
        else:
            values[fn][column] = kl[part]
        if column == "kl":
            values[fn]["kl_seq"] = kl_seq[part]
    return {fn: _table(real, valid, values[fn], directions) for fn, (real, valid) in reals.items()}


def _table(real: pa.Table, valid: np.ndarray, values: dict[str, np.ndarray], directions: int) -> pa.Table:
    """A class's `PERTURB` rows: every `real` anchor, its KLs null where it has no patch (or, for `kl_other`,
    where no other anchor had one)."""
    table: dict[str, pa.Array | pa.ChunkedArray] = {"seq_id": real["seq_id"], "pos": real["pos"]}
    for name in ("kl", "kl_seq", "kl_random", "kl_other"):
        full = np.full(len(valid), np.nan)
        present = valid & (name in values)
        if name in values:
            full[valid] = values[name]
        table[name] = pa.array(full, mask=~present)
    table["n_random"] = pa.array(np.full(len(valid), directions, dtype=np.int32), mask=~valid)
    each = np.full((len(valid), directions), np.nan)
    each[valid] = values["kl_directions"]
    flat = pa.array(each.reshape(-1))
    table["kl_directions"] = pa.ListArray.from_arrays(
        pa.array(np.arange(len(valid) + 1) * directions, pa.int32()), flat, mask=pa.array(~valid)
    )
    return pa.table(table, schema=PERTURB.file_schema())
