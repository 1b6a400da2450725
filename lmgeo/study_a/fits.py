"""Tokenwise fits of one layer transition `h_l → h_{l+1}` and their geometry (SPEC §4.2, §4.5).

For every anchor `i`, a map `T_i` of each function class (`lmgeo.study_a.classes`) is fitted on the
anchor's `k` nearest neighbour pairs `(x_j, y_j) = (h_l, h_{l+1})`, or once for the layer, and evaluated at
the anchor. The neighbours are searched once per pool and shared by every class. All anchors of a layer are
fitted at once with batched tensor code, in float64.

Geometry at anchor `i` (`x, y` its `h_l, h_{l+1}`): `Δ_full = y − x`, `Δ_tok = T_i(x) − x`,
`r = Δ_full − Δ_tok` (`lmgeo.study_a.geometry`). `k` is `cfg.k` on every row, also for the layer-wide
classes, which ignore it.

Identification (SPEC §4.5, `lmgeo.study_a.identification`), per anchor and per quantity, from one
eigendecomposition of each neighbourhood's input Gram shared by every class (and one of the centred inputs,
shared by the classes that centre them, `FitClass.centres_inputs`): `value_identified` (the anchor's input lies
in the span of its neighbours' inputs at the data's float32 resolution, so `T_i(x_a)` is a fact of the data;
else the value metrics and `patched` are null, and the anchor takes no part in the layer's global subspace) and
`operator_identified` (the neighbours' inputs have the rank the class needs, `FitClass.needs_rank`, and the
class's own solve is unique, `Update.unidentified`; else `proj_full`, `proj_res`, `subspace_tied` and
`subspace_dim` are null). One rule for every class: a class that centres its inputs (`mlp`) is judged on
`x_j − μ` and `x_a − μ` (the affine span).

Layer-wide fits of the local classes (partition `fn = "<class>.layer"`): the same class fitted once on every
pair of the pool (the anchor's own pair among them) and evaluated at the same anchors, identified the same
way on the pool's inputs: the locality claim compares a class with itself. `locality` is each anchor's
distance to its k-th neighbour over the median distance between distinct rows of the pool (exact over every
pair up to 4096 rows, else over seeded random pairs: `knn.median_pair_distance`; null for a layer-wide fit).

Null samples (SPEC §4.5): besides the model's own pairs (`real`), the same fits run on `shuffled` pairs
(`h_{l+1}` permuted across the pool: no relation between a token's input and output) and on a `gaussian`
pool (as many pairs drawn from the Gaussian with the pool's joint mean and covariance of `(h_l, h_{l+1})`:
its second moments, nothing more). Their rows carry the ids of the pool row they replace and the same anchors.
Every class, `mlp` included, is fitted on every sample.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from lmgeo.core.contracts import FIT_METRICS, FITS, VALUE_METRICS, arrow_to_vectors, vectors_to_arrow
from lmgeo.study_a.classes import FIT_CLASSES
from lmgeo.study_a.classes.base import FitContext
from lmgeo.study_a.config import AnalysisConfig
from lmgeo.study_a.geometry import RCOND, Update, as_float64, global_basis, update_metrics
from lmgeo.study_a.identification import Identification, NeighbourhoodGram, identify
from lmgeo.study_a.knn import median_pair_distance, nearest_neighbours, neighbour_distances


@dataclass(frozen=True)
class FitInfo:
    d: int
    n_pool: int  # finite pool rows the fits used
    n_nonfinite: int  # pool rows excluded for a NaN/Inf in h_l or h_{l+1}
    n_anchors: int  # anchors fitted (rows of each table)
    n_anchors_dropped: int  # requested anchors excluded because their own row is non-finite


# ------------------------------------------------------------------------------------ public API
def finite_rows(x: np.ndarray | Tensor, y: np.ndarray | Tensor) -> np.ndarray:
    """Rows of the pool whose `h_l` and `h_{l+1}` are both finite (the others are excluded)."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    return (torch.isfinite(x).all(dim=1) & torch.isfinite(y).all(dim=1)).cpu().numpy()


def choose_anchors(n_pool: int, n_anchors: int, seed: int, valid_mask: np.ndarray | None = None) -> np.ndarray:
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
    classes: list[str],
    cfg: AnalysisConfig,
    device: str | torch.device = "cpu",
    samples: tuple[str, ...] = ("real",),
) -> tuple[dict[str, pa.Table], FitInfo]:
    """Fit every class of `classes` at every anchor (pool row indices) of one (model, layer) and measure it,
    on the real pairs and on each null sample of `samples`:
    `{fn: table}` for every partition of `partitions(classes)` (each local class also fitted once for the
    layer), the samples' rows stacked.

    `X = h_l`, `Y = h_{l+1}`, `(pool, d)`. Pool rows with a non-finite value are dropped from the pool
    and from the anchors, and counted. Each sample has one row per kept anchor, in `anchor_idx` order.
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
    ids = {
        name: np.asarray(col)[kept_anchors] for name, col in (("seq_id", seq_id), ("pos", pos), ("token_id", token_id))
    }

    parts: dict[str, list[pa.Table]] = {fn: [] for fn in partitions(classes)}
    real_neighbours = functools.cache(lambda: _neighbours(x, anchors, seq_of_row, classes, cfg))
    for sample in samples:
        xs, ys = null_sample(x, y, sample, cfg.seed)
        # `shuffled` permutes the outputs only: it shares the real inputs' neighbours, searched once whatever
        # the order of the samples; `gaussian` draws new inputs, which need their own.
        neighbours = real_neighbours() if xs is x else _neighbours(xs, anchors, seq_of_row, classes, cfg)
        pool = _pool(xs, ys, anchors, neighbours, n_nonfinite, cfg)
        for fn, fitted in fit_classes(pool, classes, cfg).items():
            parts[fn].append(_fit_table(sample, ids, cfg, pool, fitted))
    info = FitInfo(x.shape[1], x.shape[0], n_nonfinite, len(kept_anchors), len(anchor_idx) - len(kept_anchors))
    return {fn: pa.concat_tables(tables) for fn, tables in parts.items()}, info


def null_sample(x: Tensor, y: Tensor, sample: str, seed: int) -> tuple[Tensor, Tensor]:
    """The pairs of `sample`: `real` as given, `shuffled` with the outputs permuted across the pool,
    `gaussian` drawn from the Gaussian with the pool's joint mean and covariance (seeded; SPEC §4.5)."""
    generator = torch.Generator().manual_seed(seed)
    if sample == "real":
        return x, y
    if sample == "shuffled":
        return x, y[torch.randperm(len(y), generator=generator).to(y.device)]
    if sample == "gaussian":
        joint = torch.cat([x, y], dim=1)
        mean = joint.mean(dim=0)
        values, vectors = torch.linalg.eigh(torch.cov(joint.T))
        # cov's symmetric square root (cov = root², also when it is singular): unique, so the draws do not depend
        # on the basis an eigensolver picks among close eigenvalues, which rounding of the pool would move; and
        # an eigenvalue at rounding level is 0 (a square root would move with its rounding: y tokenwise in x
        # makes the joint covariance singular)
        values = values.where(values > RCOND * values.amax(), 0.0)
        root = (vectors * values.sqrt()) @ vectors.T
        normal = torch.randn(joint.shape, generator=generator, dtype=joint.dtype).to(joint.device)
        drawn = mean + normal @ root
        return drawn[:, : x.shape[1]].contiguous(), drawn[:, x.shape[1] :].contiguous()
    raise ValueError(f"unknown sample {sample!r}")


def select_pool(n: int, pool_size: int | None, seed: int) -> np.ndarray:
    """A seeded subset of the stored tokens (all of them by default), in stored order."""
    if pool_size is None or pool_size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=pool_size, replace=False))


def fit_transition(
    h_in: pa.Table, h_out: pa.Table, cfg: AnalysisConfig, device: str | torch.device
) -> dict[str, pa.Table]:
    """The fit table of every configured class on one layer transition, for the real pairs and every null
    sample of `cfg.nulls`, from the activation rows of `h_l` and `h_{l+1}`
    (`lmgeo.core.contracts.ACTIVATIONS`, in row order): pool, anchors, neighbours, fits, geometry."""
    ids, x = _ids_and_vectors(h_in)
    ids_next, y = _ids_and_vectors(h_out)
    if not np.array_equal(ids, ids_next):
        raise ValueError("the two layers of a transition hold different tokens")
    pool = select_pool(len(x), cfg.pool_size, cfg.seed)
    x, y, ids = x[pool], y[pool], ids[pool]
    anchors = choose_anchors(len(x), cfg.anchors, cfg.seed, finite_rows(x, y))
    samples = ("real", *cfg.nulls)
    tables, _info = fit_layer(x, y, ids[:, 0], ids[:, 1], ids[:, 2], anchors, cfg.classes, cfg, device, samples)
    return tables


def _ids_and_vectors(rows: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n, 3) int32 of seq_id, pos, token_id; vectors (n, d) float32)."""
    ids = np.stack([rows[c].to_numpy() for c in ("seq_id", "pos", "token_id")], axis=1).astype(np.int32)
    return ids, arrow_to_vectors(rows["h"])


class _Pool(NamedTuple):
    """One sample's finite pool, its anchors (rows) and their shared neighbours (None: no local class)."""

    x: Tensor
    y: Tensor
    anchors: Tensor
    neighbours: Tensor | None
    n_nonfinite: int
    n_distinct: int  # distinct input vectors in the pool
    locality: Tensor | None  # (A,) k-th neighbour distance over the pool's median pair distance


class Fitted(NamedTuple):
    """One class's fit at every anchor of a pool, and what the data determine of it (SPEC §4.5)."""

    update: Update
    value_identified: Tensor  # (A,)
    operator_identified: Tensor  # (A,)
    input_rank: Tensor | None  # (A,) for a fit on neighbours' (or the pool's) inputs; None for a baseline
    locality: Tensor | None  # (A,) for a fit on each anchor's neighbours


# The neighbourhoods of at most this many float64 values are gathered at once ((A, k, d) inputs and outputs,
# and a class's (A, d, d) operators): memory is bounded by the chunk, not by the number of anchors. At
# k = d = 2048 that is 8 anchors a chunk; at the tests' sizes, every anchor in one.
CHUNK_VALUES = 2**25
LAYER_SUFFIX = ".layer"  # the partition `fn` of a local class fitted once for the whole layer


def partitions(classes: list[str]) -> list[str]:
    """The `fn` partitions `fit_layer` writes for `classes`: each class, then each local class's layer-wide fit."""
    return [*classes, *(fn + LAYER_SUFFIX for fn in classes if FIT_CLASSES[fn].local)]


def anchor_chunks(n_anchors: int, k: int, d: int) -> list[slice]:
    """Consecutive slices of the anchors, each gathering at most `CHUNK_VALUES` values per tensor."""
    size = max(1, CHUNK_VALUES // (max(k, d) * d))
    return [slice(start, min(start + size, n_anchors)) for start in range(0, n_anchors, size)]


def _pool(
    x: Tensor, y: Tensor, anchors: Tensor, neighbours: Tensor | None, n_nonfinite: int, cfg: AnalysisConfig
) -> _Pool:
    n_distinct = int(torch.unique(x, dim=0).shape[0])
    locality = None if neighbours is None else _locality(x, anchors, neighbours, cfg)
    return _Pool(x, y, anchors, neighbours, n_nonfinite, n_distinct, locality)


def _locality(x: Tensor, anchors: Tensor, neighbours: Tensor, cfg: AnalysisConfig) -> Tensor:
    """Each anchor's distance to its k-th neighbour over the pool's median distance between distinct rows
    (`median_pair_distance`: exact up to 4096 rows, else from pairs seeded by `cfg.seed`), both in
    `cfg.distance` (NaN where that median is 0)."""
    kth = neighbour_distances(x, anchors, neighbours, cfg.distance).amax(dim=1)
    typical = median_pair_distance(x, cfg.distance, seed=cfg.seed)
    return kth / typical if typical > 0 else torch.full_like(kth, torch.nan)


def _neighbours(
    x: Tensor, anchors: Tensor, seq_of_row: Tensor, classes: list[str], cfg: AnalysisConfig
) -> Tensor | None:
    if not any(FIT_CLASSES[fn].local for fn in classes):
        return None
    seq = seq_of_row if cfg.exclude_same_sequence else None
    return nearest_neighbours(x, anchors, cfg.k, distance=cfg.distance, seq_id=seq, chunk=cfg.knn_chunk)


def fit_classes(pool: _Pool, classes: list[str], cfg: AnalysisConfig) -> dict[str, Fitted]:
    """Every class of `classes` and every local class's layer-wide fit (`partitions`) at the pool's anchors."""
    local = [fn for fn in classes if FIT_CLASSES[fn].local]
    x_a = pool.x[pool.anchors]
    pool_gram = NeighbourhoodGram(pool.x[None])  # shared by the layer-wide fits of the local classes
    fitted = _local_fits(pool, local, cfg) if local else {}
    for fn in classes:
        if not FIT_CLASSES[fn].local:
            update = FIT_CLASSES[fn].fit(pool.x, pool.y, pool.anchors, cfg, FitContext(0, pool_gram))
            everywhere = torch.ones(len(pool.anchors), dtype=torch.bool, device=pool.x.device)
            fitted[fn] = Fitted(update, everywhere, everywhere, None, None)
    if local:
        identifications = _identifications(pool.x[None], x_a, pool_gram, local)
        for fn in local:
            update = FIT_CLASSES[fn].fit(pool.x[None], pool.y[None], x_a, cfg, FitContext(0, pool_gram))
            update = update._replace(
                **{
                    name: getattr(update, name).expand(len(x_a))
                    for name in _PER_ANCHOR
                    if getattr(update, name) is not None
                }
            )
            identification = identifications[FIT_CLASSES[fn].centres_inputs]
            rank = identification.input_rank.expand(len(x_a))
            fitted[fn + LAYER_SUFFIX] = _identified(fn, update, identification._replace(input_rank=rank), None)
    return {fn: fitted[fn] for fn in partitions(classes)}


def _identifications(
    xn: Tensor, x_a: Tensor, gram: NeighbourhoodGram, classes: list[str]
) -> dict[bool, Identification]:
    """The identification of the neighbourhoods `xn` (A or 1, k, d) at the anchors' inputs `x_a` (A, d), on the
    raw inputs (key False) and, where a class of `classes` centres them, on the inputs centred on each
    neighbourhood's mean (key True): one rule, on what each class sees."""
    out = {False: identify(xn, x_a, gram)}
    if any(FIT_CLASSES[fn].centres_inputs for fn in classes):
        mean = xn.mean(dim=1, keepdim=True)
        centred = xn - mean
        out[True] = identify(centred, x_a - mean[:, 0], NeighbourhoodGram(centred))
    return out


_PER_ANCHOR = ("unidentified", "converged")  # `Update` fields a layer-wide fit states once for every anchor


def _local_fits(pool: _Pool, local: list[str], cfg: AnalysisConfig) -> dict[str, Fitted]:
    """The local classes at every anchor, chunk by chunk: each neighbourhood is gathered, its Gram formed
    and its identification decided once, for every class."""
    assert pool.neighbours is not None
    updates: dict[str, list[Update]] = {fn: [] for fn in local}
    chunks: list[dict[bool, Identification]] = []
    for chunk in anchor_chunks(len(pool.anchors), pool.neighbours.shape[1], pool.x.shape[1]):
        index = pool.neighbours[chunk]
        xn, yn, x_a = pool.x[index], pool.y[index], pool.x[pool.anchors[chunk]]
        gram = NeighbourhoodGram(xn)
        chunks.append(_identifications(xn, x_a, gram, local))
        for fn in local:
            updates[fn].append(FIT_CLASSES[fn].fit(xn, yn, x_a, cfg, FitContext(chunk.start, gram)))
    identification = {
        key: Identification(*(torch.cat(parts) for parts in zip(*(c[key] for c in chunks), strict=True)))
        for key in chunks[0]
    }
    return {
        fn: _identified(fn, _concat(updates[fn]), identification[FIT_CLASSES[fn].centres_inputs], pool.locality)
        for fn in local
    }


def _identified(fn: str, update: Update, identification: Identification, locality: Tensor | None) -> Fitted:
    """What the data determine of a fit of class `fn` (SPEC §4.5), from the identification of what it sees."""
    fit_class = FIT_CLASSES[fn]
    operator = identification.input_rank >= fit_class.needs_rank(update.delta_tok.shape[1])
    if update.unidentified is not None:
        operator &= ~update.unidentified
    return Fitted(update, identification.in_span, operator, identification.input_rank, locality)


def _concat(parts: list[Update]) -> Update:
    """The updates of consecutive anchor chunks as one."""
    first = parts[0]
    basis = type(first.basis)(*(torch.cat(fields) for fields in zip(*(u.basis for u in parts), strict=True)))

    def optional(name: str) -> Tensor | None:
        return None if getattr(first, name) is None else torch.cat([getattr(u, name) for u in parts])

    return Update(torch.cat([u.delta_tok for u in parts]), basis, optional("unidentified"), optional("converged"))


def _fit_table(sample: str, ids: dict[str, np.ndarray], cfg: AnalysisConfig, pool: _Pool, fitted: Fitted) -> pa.Table:
    update = fitted.update
    x_a, y_a = pool.x[pool.anchors], pool.y[pool.anchors]
    global_ = global_basis(update.delta_tok[fitted.value_identified], cfg.p)
    metrics = update_metrics(x_a, y_a, update.delta_tok, update.basis, global_)
    n, d = x_a.shape
    schema = FITS.file_schema(d)
    no_value, no_operator = (~fitted.value_identified).cpu().numpy(), (~fitted.operator_identified).cpu().numpy()
    columns = {"sample": pa.array([sample] * n, pa.string())}
    columns |= {name: pa.array(values.astype(np.int32), pa.int32()) for name, values in ids.items()}
    columns["k"] = pa.array(np.full(n, cfg.k, dtype=np.int32))
    columns["locality"] = _optional(fitted.locality, n, pa.float64())
    for name in FIT_METRICS:
        values = metrics[name].cpu().numpy()
        unknown = no_value if name in VALUE_METRICS else no_operator
        columns[name] = pa.array(values, pa.float64(), mask=np.isnan(values) | unknown)
    columns["input_rank"] = _optional(fitted.input_rank, n, pa.int32())
    columns["value_identified"] = pa.array(~no_value)
    columns["operator_identified"] = pa.array(~no_operator)
    columns["converged"] = _optional(update.converged, n, pa.bool_())
    tied, dim = (v.expand(n) if v.numel() == 1 else v for v in (update.basis.tied, update.basis.dim()))
    columns["subspace_tied"] = pa.array(tied.cpu().numpy(), mask=no_operator)
    columns["subspace_dim"] = pa.array(dim.cpu().numpy().astype(np.int32), mask=no_operator)
    columns["patched"] = vectors_to_arrow((x_a + update.delta_tok).float().cpu().numpy(), null=no_value)
    columns["n_nonfinite"] = pa.array(np.full(n, pool.n_nonfinite, dtype=np.int32))
    columns["n_distinct"] = pa.array(np.full(n, pool.n_distinct, dtype=np.int32))
    return pa.Table.from_pydict(columns, schema=schema)


def _optional(values: Tensor | None, n: int, kind: pa.DataType) -> pa.Array:
    """A per-anchor column, all null where the fit has no such value; NaN is null too."""
    if values is None:
        return pa.nulls(n, kind)
    array = values.cpu().numpy()
    mask = np.isnan(array) if array.dtype.kind == "f" else None
    return pa.array(array, kind, mask=mask)
