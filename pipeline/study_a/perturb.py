"""The perturbation of one layer transition (SPEC §4.3, §4.5): for every fitted anchor of every class, the
KL of the next-token distribution when block l's output at the anchor's token is replaced by the fitted
`T_i(h_l)` (`kl`, `kl_seq`), and by the two null patches of `pipeline.study_a.nulls` (`kl_random`,
`kl_other`).

The sequences are replayed from the stored activations (layer 0 holds every token id); `h_{l+1}` at the
anchors is the clean output the null patches are measured from. Every patched copy of every class goes
through one `patch_kl_anchors` call, so each sequence's clean pass runs once for all of them. An anchor
whose value is not identified (no `patched` vector) gets null KLs.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from transformers import PreTrainedModel

from pipeline.core.contracts import PERTURB
from pipeline.core.store import arrow_to_vectors
from pipeline.study_a.nulls import null_patches
from pipeline.study_a.patching import patch_kl_anchors


def perturb_layer(
    model: PreTrainedModel, tokens_rows: pa.Table, outputs: pa.Table, fits: dict[str, pa.Table], layer: int,
    seed: int, batch_size: int,
) -> dict[str, pa.Table]:
    """One `PERTURB` table per class of `fits`, in its order.

    `tokens_rows`: the activations of layer 0 (`seq_id`, `token_id`), every token of every sequence;
    `outputs`: those of layer `layer + 1` (`seq_id`, `pos`, `h`); `fits[fn]`: the class's fit rows
    (`sample`, `seq_id`, `pos`, `patched`), of which the `real` sample's anchors are patched. Class number
    `index` (its place in `fits`) draws its null patches from `default_rng([seed, layer, index])`.
    """
    sequences = np.unique(tokens_rows["seq_id"].to_numpy())
    seq_len = len(tokens_rows) // len(sequences)
    tokens = tokens_rows["token_id"].to_numpy().astype(np.int64).reshape(len(sequences), seq_len)
    h_next = arrow_to_vectors(outputs["h"]).reshape(len(sequences), seq_len, -1)
    copies, per_class = [], {}
    for index, (fn, rows_of_class) in enumerate(fits.items()):
        real = rows_of_class.filter(pc.equal(rows_of_class["sample"], "real"))
        rows = np.searchsorted(sequences, real["seq_id"].to_numpy())
        pos = real["pos"].to_numpy()
        patches = null_patches(real["patched"], h_next[rows, pos], np.random.default_rng([seed, layer, index]))
        per_class[fn] = (real, len(copies), patches.valid)
        copies += [(rows[patches.valid], pos[patches.valid], v) for v in (patches.real, patches.random, patches.other)]
    rows, pos, vectors = (np.concatenate(part) for part in zip(*copies, strict=True))
    kl, kl_seq = patch_kl_anchors(model, tokens, rows, pos, layer, vectors, batch_size)
    bounds = np.cumsum([0] + [len(c[0]) for c in copies])
    tables = {}
    for fn, (real, first, valid) in per_class.items():
        part = [slice(bounds[first + i], bounds[first + i + 1]) for i in range(3)]
        columns = {"kl": kl[part[0]], "kl_seq": kl_seq[part[0]], "kl_random": kl[part[1]], "kl_other": kl[part[2]]}
        table = {"seq_id": real["seq_id"], "pos": real["pos"]}
        for name, values in columns.items():  # null where the value is not identified (no patch)
            full = np.full(len(valid), np.nan)
            full[valid] = values
            table[name] = pa.array(full, mask=~valid)
        tables[fn] = pa.table(table, schema=PERTURB.file_schema())
    return tables
