"""Tokenwise fits of one layer transition `h_l → h_{l+1}` and their geometry (SPEC §4.2).

For every anchor `i`, a map `T_i` of one function class (`pipeline.study_a.classes`) is fitted on the
anchor's `k` nearest neighbour pairs `(x_j, y_j) = (h_l, h_{l+1})`, or once for the layer, and evaluated at
the anchor. All anchors of a layer are fitted at once with batched tensor code, in float64.

Geometry at anchor `i` (`x, y` its `h_l, h_{l+1}`): `Δ_full = y − x`, `Δ_tok = T_i(x) − x`,
`r = Δ_full − Δ_tok` (`pipeline.study_a.geometry`). `k` is `cfg.k` on every row, also for the layer-wide
classes, which ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from pipeline.core.contracts import FIT_METRICS, FITS
from pipeline.core.store import arrow_to_vectors
from pipeline.study_a.classes import FIT_CLASSES
from pipeline.study_a.config import AnalysisConfig
from pipeline.study_a.geometry import Update, as_float64, global_basis, update_metrics
from pipeline.study_a.knn import nearest_neighbours


@dataclass(frozen=True)
class FitInfo:
    fn: str
    d: int
    n_pool: int  # finite pool rows the fits used
    n_nonfinite: int  # pool rows excluded for a NaN/Inf in h_l or h_{l+1}
    n_anchors: int  # anchors fitted (rows of the table)
    n_anchors_dropped: int  # requested anchors excluded because their own row is non-finite


# ------------------------------------------------------------------------------------ public API
def finite_rows(x: np.ndarray | Tensor, y: np.ndarray | Tensor) -> np.ndarray:
    """Rows of the pool whose `h_l` and `h_{l+1}` are both finite (the others are excluded)."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    return (torch.isfinite(x).all(dim=1) & torch.isfinite(y).all(dim=1)).cpu().numpy()


def choose_anchors(
    n_pool: int, n_anchors: int, seed: int, valid_mask: np.ndarray | None = None
) -> np.ndarray:
    """A seeded random subset of the valid pool rows, sorted; `min(n_anchors, #valid)` of them."""
    if valid_mask is not None and len(valid_mask) != n_pool:
        raise ValueError(f"valid_mask has {len(valid_mask)} rows, the pool {n_pool}")
    valid = np.arange(n_pool) if valid_mask is None else np.flatnonzero(np.asarray(valid_mask, dtype=bool))
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(valid, size=min(n_anchors, valid.size), replace=False))


def fit_layer(
    X: np.ndarray | Tensor,
    Y: np.ndarray | Tensor,
    seq_id: np.ndarray,
    pos: np.ndarray,
    token_id: np.ndarray,
    anchor_idx: np.ndarray,
    fn: str,
    cfg: AnalysisConfig,
    device: str | torch.device = "cpu",
) -> tuple[pa.Table, FitInfo]:
    """Fit class `fn` at every anchor (pool row indices) of one (model, layer) and measure it.

    `X = h_l`, `Y = h_{l+1}`, `(pool, d)`. Pool rows with a non-finite value are dropped from the pool
    and from the anchors, and counted. Returns one row per kept anchor, in `anchor_idx` order.
    """
    x, y = as_float64(X, device), as_float64(Y, device)
    if x.ndim != 2 or x.shape != y.shape:
        raise ValueError(f"X and Y must both be (pool, d), got {tuple(x.shape)} and {tuple(y.shape)}")
    finite = finite_rows(x, y)
    anchor_idx = np.asarray(anchor_idx, dtype=np.int64)
    if anchor_idx.size and (anchor_idx.min() < 0 or anchor_idx.max() >= len(finite)):
        raise ValueError(f"anchor indices must lie in [0, {len(finite)})")
    kept_anchors = anchor_idx[finite[anchor_idx]]
    n_nonfinite = int((~finite).sum())
    if kept_anchors.size == 0:
        raise ValueError(f"no finite anchor among {anchor_idx.size} ({n_nonfinite} non-finite pool rows)")
    compact = np.cumsum(finite) - 1  # pool row -> row of the finite pool
    rows = torch.as_tensor(np.flatnonzero(finite), device=x.device)
    x, y = x[rows], y[rows]
    anchors = torch.as_tensor(compact[kept_anchors], device=x.device)
    seq_of_row = torch.as_tensor(np.asarray(seq_id)[finite], device=x.device)

    update = fit_update(x, y, anchors, seq_of_row, fn, cfg)
    x_a, y_a = x[anchors], y[anchors]
    global_ = global_basis(update.delta_tok, cfg.p)
    ids = {"seq_id": seq_id, "pos": pos, "token_id": token_id}
    table = _fit_table(
        ids={name: np.asarray(col)[kept_anchors] for name, col in ids.items()},
        k=cfg.k,
        metrics=update_metrics(x_a, y_a, update.delta_tok, update.basis, global_),
        patched=(x_a + update.delta_tok).float().cpu().numpy(),
        n_nonfinite=n_nonfinite,
    )
    n_kept = len(kept_anchors)
    info = FitInfo(fn, x.shape[1], x.shape[0], n_nonfinite, n_kept, len(anchor_idx) - n_kept)
    return table, info


def select_pool(n: int, pool_size: int | None, seed: int) -> np.ndarray:
    """A seeded subset of the stored tokens (all of them by default), in stored order."""
    if pool_size is None or pool_size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=pool_size, replace=False))


def fit_transition(h_in: pa.Table, h_out: pa.Table, fn: str, cfg: AnalysisConfig, device: str | torch.device) -> pa.Table:
    """The fit table of class `fn` on one layer transition, from the activation rows of `h_l` and
    `h_{l+1}` (`pipeline.core.contracts.ACTIVATIONS`, in row order): pool, anchors, fits, geometry."""
    ids, x = _ids_and_vectors(h_in)
    ids_next, y = _ids_and_vectors(h_out)
    if not np.array_equal(ids, ids_next):
        raise ValueError("the two layers of a transition hold different tokens")
    pool = select_pool(len(x), cfg.pool_size, cfg.seed)
    x, y, ids = x[pool], y[pool], ids[pool]
    anchors = choose_anchors(len(x), cfg.anchors, cfg.seed, finite_rows(x, y))
    table, _info = fit_layer(x, y, ids[:, 0], ids[:, 1], ids[:, 2], anchors, fn, cfg, device=device)
    return table


def _ids_and_vectors(rows: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n, 3) int32 of seq_id, pos, token_id; vectors (n, d) float32)."""
    ids = np.stack([rows[c].to_numpy() for c in ("seq_id", "pos", "token_id")], axis=1).astype(np.int32)
    return ids, arrow_to_vectors(rows["h"])


def fit_update(
    x: Tensor, y: Tensor, anchors: Tensor, seq_of_row: Tensor, fn: str, cfg: AnalysisConfig
) -> Update:
    """`Δ_tok` and the local update subspace at every anchor, for a finite float64 pool."""
    fit_class = FIT_CLASSES[fn]
    x_a = x[anchors]
    if not fit_class.local:
        return fit_class.fit(x, y, x_a, cfg)
    nb = nearest_neighbours(
        x,
        anchors,
        cfg.k,
        distance=cfg.distance,
        seq_id=seq_of_row if cfg.exclude_same_sequence else None,
        chunk=cfg.knn_chunk,
    )
    return fit_class.fit(x[nb.index], y[nb.index], x_a, cfg)  # neighbours: (A, k, d)


def _fit_table(
    ids: dict[str, np.ndarray], k: int, metrics: dict[str, Tensor], patched: np.ndarray, n_nonfinite: int
) -> pa.Table:
    n, d = patched.shape
    schema = FITS.file_schema(d)
    columns = {name: pa.array(values.astype(np.int32), pa.int32()) for name, values in ids.items()}
    columns["k"] = pa.array(np.full(n, k, dtype=np.int32))
    for name in FIT_METRICS:
        values = metrics[name].cpu().numpy()
        columns[name] = pa.array(values, pa.float64(), mask=np.isnan(values))
    columns["patched"] = pa.FixedSizeListArray.from_arrays(pa.array(patched.reshape(-1), pa.float32()), d)
    columns["n_nonfinite"] = pa.array(np.full(n, n_nonfinite, dtype=np.int32))
    return pa.Table.from_pydict(columns, schema=schema)
