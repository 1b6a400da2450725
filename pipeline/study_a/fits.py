"""Tokenwise fits of one layer transition `h_l → h_{l+1}` and their geometry (SPEC §4.2).

For every anchor `i`, a map `T_i` of one function class is fitted on the anchor's `k` nearest
neighbour pairs `(x_j, y_j) = (h_l, h_{l+1})` and evaluated at the anchor. All anchors of a layer are
fitted at once with batched tensor code; everything is computed in float64 (neighbour order, rank
cut-offs and the 1e-4 agreement with a per-anchor reference all depend on it).

Exact methods (`λ` = `ridge`; vectors are columns; sums run over the neighbours `j`):
- `diag_psd`: `T(x) = D x`, `d_c = max(0, Σ x_c y_c / (Σ x_c² + λ))`, the per-coordinate ridge
  solution projected on `D ≥ 0` (exact, since the coordinates decouple).
- `lowrank`: `T(x) = x + U Vᵀ x`, the rank-`r` `B = UVᵀ` minimising
  `Σ ‖(y_j − x_j) − B x_j‖² + λ‖B‖²_F`. That is reduced-rank regression on the ridge-augmented data
  `[X, √λI] → [E, 0]`: `B̂ = E Xᵀ(XXᵀ + λI)⁻¹`, `U` = top-`r` left singular vectors of the augmented
  fitted values `B̂[X, √λI]`, `V = B̂ᵀU` (exact for `λ > 0`). Computed through the smaller of the Gram
  matrices `XᵀX` (`k × k`) and `XXᵀ` (`d × d`).
- `orthogonal`: `T(x) = s Q x`, Procrustes pulled towards the identity:
  `Q = argmin Σ‖y_j − Q x_j‖² + λ‖Q − I‖²_F = polar(Σ y_j x_jᵀ + λI)`. With `S` the span of the
  neighbours' inputs and outputs, this `Q` is exactly the identity on `S⊥`, as SPEC asks; the `λ` term
  also makes `Q` unique inside `S`, where the plain Procrustes optimum is not unique once `k < dim S`:
  it is the optimum closest to the identity (the `λ → 0⁺` limit). `λ > 0` is needed for uniqueness.
  `Q` is stored as `I + B (Q_S − I) Bᵀ`, `B` an orthonormal basis of `S` (of R^d once `2k ≥ d`). With `orthogonal_scale`,
  `s = ⟨Σ y_j x_jᵀ, Q⟩ / Σ‖x_j‖²` (the least-squares scale given `Q`), else `s = 1`.
- `mlp`: `T(x) = x + τ (W₂ tanh(W₁ (x − μ)/σ + b₁) + b₂)`, one hidden layer of `mlp_hidden` units,
  fitted per anchor neighbourhood. `μ` is the neighbours' mean input, `σ` the RMS of the centred
  inputs and `τ` the RMS of the updates `y_j − x_j`, so that Adam sees unit-scale problems. Loss per
  anchor: `mean_{j,c} (residual/τ)² + λ(‖W₁‖² + ‖W₂‖²)`; `mlp_steps` steps of Adam (lr 1e-2) from
  `W₁ ~ N(0, 1/d)` (drawn on the CPU from `seed`, so every device starts alike), `b₁ = W₂ = b₂ = 0`.
  Anchors are independent problems: Adam is element-wise, so one optimiser on the summed loss is
  exactly one optimiser per anchor.
- `identity`: `T(x) = x`.
- `global_linear`: `T(x) = A x + b`, ridge on `A` (not on `b`), fitted on the whole finite pool.

Geometry at anchor `i` (`x, y` its `h_l, h_{l+1}`): `Δ_full = y − x`, `Δ_tok = T_i(x) − x`,
`r = Δ_full − Δ_tok`. The local update operator is `J_i − I`, `J_i` the Jacobian of `T_i` at `x`
(`D`, `I + UVᵀ`, `sQ`, `I + (τ/σ) W₂ diag(tanh') W₁`, `A`). Its dominant subspace is spanned by the
left singular vectors of the `p` largest singular values, widened to every singular value tied with
the `p`-th (within 1e-8 relative; a subspace that splits a tie is not defined, and ties are common:
`sQ − I` pairs its singular values per rotation plane, and every clamped `d_c = 0` has
`|d_c − 1| = 1`), and never including a zero singular value (below 1e-12 of the largest): when the
operator has rank below `p`, the subspace is its range. For `orthogonal` with a scale, `sQ − I` has
the singular value `|s − 1|` on `S⊥`, the smallest it can have, so the subspace lies inside `S`.
The global subspace is the same construction on the stacked `Δ_tok` of this call's anchors (right
singular vectors). A column is null where it is undefined: a zero vector in a ratio or an angle, or
no non-zero singular value (e.g. `identity`, where `Δ_tok = 0`). `k` is `cfg.k` on every row, also
for the two baselines, which ignore it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from pipeline.core.config import AnalysisConfig
from pipeline.study_a.knn import nearest_neighbours

METRICS = (
    "rel_err",
    "rel_err_state",
    "cos_full_tok",
    "cos_full_res",
    "angle_res_tok",
    "proj_full",
    "proj_res",
    "proj_full_global",
    "proj_res_global",
    "norm_full",
    "norm_res",
)
LOCAL_CLASSES = ("diag_psd", "lowrank", "orthogonal", "mlp")

_F64 = torch.float64
# Singular values (and eigenvalues of Gram matrices) below this fraction of the largest are zero.
_RCOND = 1e-12
# Singular values within this relative distance of each other are tied.
_TIE = 1e-8
_MLP_LR = 1e-2


def fit_schema(d: int) -> pa.Schema:
    """Columns of a fit table (SPEC §4.2): ids, `k`, the metrics (float64, null where undefined),
    `patched = T_i(h_l)` at the anchor for the perturb stage, and `n_nonfinite` (pool rows excluded)."""
    return pa.schema(
        [pa.field(name, pa.int32()) for name in ("seq_id", "pos", "token_id", "k")]
        + [pa.field(name, pa.float64()) for name in METRICS]
        + [pa.field("patched", pa.list_(pa.float32(), d)), pa.field("n_nonfinite", pa.int32())]
    )


@dataclass(frozen=True)
class FitInfo:
    fn: str
    d: int
    n_pool: int  # finite pool rows the fits used
    n_nonfinite: int  # pool rows excluded for a NaN/Inf in h_l or h_{l+1}
    n_anchors: int  # anchors fitted (rows of the table)
    n_anchors_dropped: int  # requested anchors excluded because their own row is non-finite


class Columns(NamedTuple):
    """A subspace per anchor as columns `(A or 1, d, q)` that are orthonormal or zero (all zero: none)."""

    columns: Tensor

    def energy(self, v: Tensor) -> Tensor:
        """`‖P v‖²` per row of `v` (A, d), `P` the projector on the subspace."""
        return (self.columns.transpose(-1, -2) @ v[..., None]).square().sum(dim=(1, 2))

    def is_defined(self) -> Tensor:
        return self.columns.square().sum(dim=(1, 2)) > 0


class CoordinateAxes(NamedTuple):
    """A subspace per anchor spanned by coordinate axes: `mask` (A, d) marks them. Equal to `Columns`
    of the selected unit vectors, in O(A·d) instead of a dense `(A, d, d)` basis."""

    mask: Tensor

    def energy(self, v: Tensor) -> Tensor:
        return v.square().where(self.mask, 0.0).sum(dim=1)

    def is_defined(self) -> Tensor:
        return self.mask.any(dim=1)


Subspace = Columns | CoordinateAxes


class Update(NamedTuple):
    """`delta_tok = T_i(x_i) − x_i` per anchor, and `basis`: the dominant subspace of `J_i − I`."""

    delta_tok: Tensor
    basis: Subspace


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
    x, y = _float64(X, device), _float64(Y, device)
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


def fit_update(
    x: Tensor, y: Tensor, anchors: Tensor, seq_of_row: Tensor, fn: str, cfg: AnalysisConfig
) -> Update:
    """`Δ_tok` and the local update subspace at every anchor, for a finite float64 pool."""
    x_a = x[anchors]
    if fn == "identity":
        return Update(torch.zeros_like(x_a), Columns(x_a.new_zeros((1, x.shape[1], cfg.p))))
    if fn == "global_linear":
        return fit_global_linear(x, y, cfg.ridge).update(x_a, cfg.p)
    if fn not in LOCAL_CLASSES:
        raise ValueError(f"unknown function class {fn!r}")
    nb = nearest_neighbours(
        x,
        anchors,
        cfg.k,
        distance=cfg.distance,
        seq_id=seq_of_row if cfg.exclude_same_sequence else None,
        chunk=cfg.knn_chunk,
    )
    xn, yn = x[nb.index], y[nb.index]  # (A, k, d)
    if fn == "diag_psd":
        return fit_diag_psd(xn, yn, cfg.ridge).update(x_a, cfg.p)
    if fn == "lowrank":
        return fit_lowrank(xn, yn, cfg.rank, cfg.ridge).update(x_a, cfg.p)
    if fn == "orthogonal":
        return fit_orthogonal(xn, yn, cfg.ridge, cfg.orthogonal_scale).update(x_a, cfg.p)
    return fit_mlp(xn, yn, cfg.mlp_hidden, cfg.mlp_steps, cfg.ridge, cfg.seed).update(x_a, cfg.p)


# ------------------------------------------------------------------------------ function classes
class DiagFit(NamedTuple):
    diag: Tensor  # (A, d), non-negative

    def update(self, x_a: Tensor, p: int) -> Update:
        return Update((self.diag - 1) * x_a, _coordinate_basis(self.diag - 1, p))


def fit_diag_psd(xn: Tensor, yn: Tensor, ridge: float) -> DiagFit:
    num = (xn * yn).sum(dim=1)
    den = (xn * xn).sum(dim=1) + ridge
    ratio = torch.where(den > 0, num / den.where(den > 0, 1.0), 0.0)  # an all-zero coordinate gets 0
    return DiagFit(ratio.clamp_min(0))


class LowRankFit(NamedTuple):
    u: Tensor  # (A, d, r), orthonormal columns
    v: Tensor  # (A, d, r); the update is B = U Vᵀ

    def update(self, x_a: Tensor, p: int) -> Update:
        delta = self.u @ (self.v.transpose(1, 2) @ x_a[..., None])
        return Update(delta[..., 0], _top_left_singular(self.u, self.v.transpose(1, 2), p))


def fit_lowrank(xn: Tensor, yn: Tensor, rank: int, ridge: float) -> LowRankFit:
    """Ridge reduced-rank regression, through the smaller of the two Gram matrices (`k × k` or `d × d`).

    `fitted` is any matrix with the left singular vectors of `B̂[X, √λI]`, i.e. a square root of
    `B̂(XXᵀ + λI)B̂ᵀ`; `U` is its top `rank`, and `V = B̂ᵀU`.
    """
    e = (yn - xn).transpose(1, 2)  # (A, d, k): updates as columns
    x_cols = xn.transpose(1, 2)  # (A, d, k): inputs as columns
    if xn.shape[1] <= xn.shape[2]:  # k ≤ d: kernel form, G = XᵀX = W diag(g) Wᵀ
        w, g, inv = _ridge_inverse(xn @ x_cols, ridge)
        u = _left_singular(e @ w * (g * inv).sqrt()[:, None, :], rank)
        v = x_cols @ (w @ (inv[..., None] * (w.transpose(1, 2) @ (e.transpose(1, 2) @ u))))
    else:  # primal form, C = XXᵀ = Z diag(c) Zᵀ, B̂ = E Xᵀ (C + λI)⁻¹
        z, _, inv = _ridge_inverse(x_cols @ xn, ridge)
        cross = e @ xn  # E Xᵀ
        u = _left_singular(cross @ z * inv.sqrt()[:, None, :], rank)
        v = z @ (inv[..., None] * (z.transpose(1, 2) @ (cross.transpose(1, 2) @ u)))
    return LowRankFit(u, v)


def _left_singular(m: Tensor, rank: int) -> Tensor:
    """An orthonormal basis of the span of the top-`rank` left singular vectors of `m` (A, d, n), from
    the `eigh` of the smaller Gram matrix instead of an SVD. Only the span matters: `B = UUᵀB̂`.

    `n < d`: with `mᵀm = V diag(s²) Vᵀ`, the span is that of `m V_top`, orthonormalised by QR (not
    divided by `s`, which may be zero). Otherwise the top eigenvectors of `m mᵀ` are the vectors."""
    if m.shape[-1] < m.shape[-2]:
        top = torch.linalg.eigh(m.transpose(1, 2) @ m).eigenvectors[..., -rank:]
        return torch.linalg.qr(m @ top).Q
    return torch.linalg.eigh(m @ m.transpose(1, 2)).eigenvectors[..., -rank:]


class OrthogonalFit(NamedTuple):
    basis: Tensor  # (A, d, m): orthonormal basis B of the span S of the neighbours' x and y (or of R^d)
    rotation: Tensor  # (A, m, m): Q_S, so Q = I + B (Q_S − I) Bᵀ
    scale: Tensor  # (A,)

    def update(self, x_a: Tensor, p: int) -> Update:
        coords = (self.basis.transpose(1, 2) @ x_a[..., None])[..., 0]
        qx = x_a + (self.basis @ ((self.rotation @ coords[..., None])[..., 0] - coords)[..., None])[..., 0]
        return Update(self.scale[:, None] * qx - x_a, self._dominant_subspace(p))

    def _dominant_subspace(self, p: int) -> Columns:
        """`_top_left_singular(B, sQ_S − I)` by one `eigh` instead of an SVD: `N = sQ_S − I` is normal,
        `NNᵀ = (s² + 1)I − s(Q_S + Q_Sᵀ)`, so the eigenvectors of `(Q_S + Q_Sᵀ)/2` are its left singular
        vectors. Their singular values are measured as `‖N v‖`, accurate where `√(s² − 2sμ + 1)` of
        an eigenvalue `μ` near 1 would cancel, and sorted (the order of `μ` flips with the sign of `s`)."""
        eye = torch.eye(self.rotation.shape[-1], dtype=self.rotation.dtype, device=self.rotation.device)
        core = self.scale[:, None, None] * self.rotation - eye
        vectors = torch.linalg.eigh((self.rotation + self.rotation.transpose(1, 2)) / 2).eigenvectors
        singular, order = (core @ vectors).norm(dim=1).sort(dim=1, descending=True, stable=True)
        vectors = vectors.gather(2, order[:, None, :].expand_as(vectors))
        return Columns(self.basis @ (vectors * _dominant(singular, p)[:, None, :]))


def fit_orthogonal(xn: Tensor, yn: Tensor, ridge: float, with_scale: bool) -> OrthogonalFit:
    basis = _span_basis(xn, yn)
    cross = (yn @ basis).transpose(1, 2) @ (xn @ basis)  # Σ y_j x_jᵀ in the coordinates of S
    eye = torch.eye(basis.shape[-1], dtype=xn.dtype, device=xn.device)
    svd = torch.linalg.svd(cross + ridge * eye)
    rotation = svd.U @ svd.Vh  # polar factor
    if not with_scale:
        return OrthogonalFit(basis, rotation, xn.new_ones(xn.shape[0]))
    energy = (xn * xn).sum(dim=(1, 2)).clamp_min(torch.finfo(_F64).tiny)
    return OrthogonalFit(basis, rotation, (cross * rotation).sum(dim=(1, 2)) / energy)


def _span_basis(xn: Tensor, yn: Tensor) -> Tensor:
    """`(A, d, min(d, 2k))` orthonormal columns spanning the neighbours' inputs and outputs. Once
    `2k ≥ d` a QR returns a basis of all of R^d, and `Q` does not depend on which: the identity."""
    n_anchors, k, d = xn.shape
    if 2 * k >= d:
        return torch.eye(d, dtype=xn.dtype, device=xn.device).expand(n_anchors, d, d)
    return torch.linalg.qr(torch.cat([xn, yn], dim=1).transpose(1, 2)).Q


class MLPFit(NamedTuple):
    centre: Tensor  # (A, d) μ
    in_scale: Tensor  # (A,) σ
    out_scale: Tensor  # (A,) τ
    w1: Tensor  # (A, h, d)
    b1: Tensor  # (A, h)
    w2: Tensor  # (A, d, h)
    b2: Tensor  # (A, d)

    def pre_activation(self, x: Tensor) -> Tensor:
        """`W₁ (x − μ)/σ + b₁` for `x` of shape (A, n, d)."""
        scaled = (x - self.centre[:, None]) / self.in_scale[:, None, None]
        return scaled @ self.w1.transpose(1, 2) + self.b1[:, None]

    def scaled_update(self, x: Tensor) -> Tensor:
        """`(T(x) − x)/τ` for `x` of shape (A, n, d)."""
        return torch.tanh(self.pre_activation(x)) @ self.w2.transpose(1, 2) + self.b2[:, None]

    def update(self, x_a: Tensor, p: int) -> Update:
        delta = self.out_scale[:, None] * self.scaled_update(x_a[:, None])[:, 0]
        slope = 1 - torch.tanh(self.pre_activation(x_a[:, None])[:, 0]) ** 2  # (A, h)
        q2, r2 = torch.linalg.qr(self.w2)  # J − I = (τ/σ) W₂ diag(slope) W₁ = Q₂ · core
        core = (self.out_scale / self.in_scale)[:, None, None] * (r2 * slope[:, None, :]) @ self.w1
        return Update(delta, _top_left_singular(q2, core, p))


def fit_mlp(xn: Tensor, yn: Tensor, hidden: int, steps: int, ridge: float, seed: int) -> MLPFit:
    n_anchors, _, d = xn.shape
    centre = xn.mean(dim=1)
    tiny = torch.finfo(_F64).tiny
    in_scale = (xn - centre[:, None]).square().mean(dim=(1, 2)).sqrt().clamp_min(tiny)
    out_scale = (yn - xn).square().mean(dim=(1, 2)).sqrt().clamp_min(tiny)
    generator = torch.Generator().manual_seed(seed)
    w1 = torch.randn((n_anchors, hidden, d), generator=generator, dtype=_F64) / math.sqrt(d)
    params = [
        w1.to(xn.device),
        xn.new_zeros((n_anchors, hidden)),
        xn.new_zeros((n_anchors, d, hidden)),
        xn.new_zeros((n_anchors, d)),
    ]
    for t in params:
        t.requires_grad_(True)
    target = (yn - xn) / out_scale[:, None, None]
    optimiser = torch.optim.Adam(params, lr=_MLP_LR)
    with torch.enable_grad():
        for _ in range(steps):
            optimiser.zero_grad()
            fit = MLPFit(centre, in_scale, out_scale, *params)
            misfit = (target - fit.scaled_update(xn)).square().mean(dim=(1, 2))
            penalty = ridge * (params[0].square().sum(dim=(1, 2)) + params[2].square().sum(dim=(1, 2)))
            (misfit + penalty).sum().backward()
            optimiser.step()
    return MLPFit(centre, in_scale, out_scale, *(t.detach() for t in params))


class GlobalLinearFit(NamedTuple):
    a: Tensor  # (d, d)
    b: Tensor  # (d,)

    def update(self, x_a: Tensor, p: int) -> Update:
        eye = torch.eye(self.a.shape[0], dtype=self.a.dtype, device=self.a.device)
        basis = _top_left_singular(eye[None], (self.a - eye)[None], p)
        return Update(x_a @ self.a.T + self.b - x_a, basis)


def fit_global_linear(x: Tensor, y: Tensor, ridge: float) -> GlobalLinearFit:
    x_mean, y_mean = x.mean(dim=0), y.mean(dim=0)
    xc, yc = x - x_mean, y - y_mean
    w, _, inv = _ridge_inverse(xc.T @ xc, ridge)
    a = (w @ (inv[:, None] * (w.T @ (xc.T @ yc)))).T  # Aᵀ = (XᵀX + λI)⁻¹ XᵀY on centred data
    return GlobalLinearFit(a, y_mean - a @ x_mean)


# -------------------------------------------------------------------------------------- geometry
def global_basis(delta_tok: Tensor, p: int) -> Columns:
    """`(1, d, p)`: the top-`p` right singular vectors of the stacked `Δ_tok` (anchors × d)."""
    eye = torch.eye(delta_tok.shape[1], dtype=delta_tok.dtype, device=delta_tok.device)
    return _top_left_singular(eye[None], delta_tok.T[None], p)


def update_metrics(
    x: Tensor, y: Tensor, delta_tok: Tensor, local: Subspace, global_: Subspace
) -> dict[str, Tensor]:
    """Every metric column per anchor, NaN where undefined (`global_` is one subspace for every anchor)."""
    full = y - x
    res = full - delta_tok
    n_full, n_tok, n_res, n_y = (v.norm(dim=1) for v in (full, delta_tok, res, y))
    has_local, has_global = local.is_defined(), global_.is_defined()
    return {
        "rel_err": _ratio(n_res, n_full),
        "rel_err_state": _ratio(n_res, n_y),
        "cos_full_tok": _ratio((full * delta_tok).sum(dim=1).abs(), n_full * n_tok),
        "cos_full_res": _ratio((full * res).sum(dim=1).abs(), n_full * n_res),
        "angle_res_tok": _angle_degrees(res, n_res, delta_tok, n_tok),
        "proj_full": _energy_fraction(full, n_full, local, has_local),
        "proj_res": _energy_fraction(res, n_res, local, has_local),
        "proj_full_global": _energy_fraction(full, n_full, global_, has_global),
        "proj_res_global": _energy_fraction(res, n_res, global_, has_global),
        "norm_full": n_full,
        "norm_res": n_res,
    }


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / den.where(den > 0, 1.0), torch.nan)


def _angle_degrees(u: Tensor, n_u: Tensor, v: Tensor, n_v: Tensor) -> Tensor:
    """Angle between `u` and `v` as `2 atan2(‖û − v̂‖, ‖û + v̂‖)`, accurate near 0° and 180°."""
    defined = (n_u > 0) & (n_v > 0)
    u_hat = u / n_u.where(defined, 1.0)[:, None]
    v_hat = v / n_v.where(defined, 1.0)[:, None]
    angle = torch.rad2deg(2 * torch.atan2((u_hat - v_hat).norm(dim=1), (u_hat + v_hat).norm(dim=1)))
    return torch.where(defined, angle, torch.nan)


def _energy_fraction(v: Tensor, n_v: Tensor, basis: Subspace, has_basis: Tensor) -> Tensor:
    """`‖P v‖² / ‖v‖²` with `P` the projector on the subspace."""
    return torch.where(has_basis, _ratio(basis.energy(v), n_v.square()), torch.nan)


def _top_left_singular(left: Tensor, core: Tensor, p: int) -> Columns:
    """Top-`p` left singular vectors of `left @ core` when `left` has orthonormal columns, as the
    columns of `left @ U` kept by `_dominant` (the others zeroed)."""
    svd = torch.linalg.svd(core, full_matrices=False)
    return Columns(left @ (svd.U * _dominant(svd.S, p)[..., None, :]))


def _coordinate_basis(diag: Tensor, p: int) -> CoordinateAxes:
    """`_top_left_singular` for a diagonal operator: the coordinate axes of the largest `|diag|`."""
    values, index = diag.abs().sort(dim=1, descending=True, stable=True)
    return CoordinateAxes(torch.zeros_like(index, dtype=torch.bool).scatter_(1, index, _dominant(values, p)))


def _dominant(singular: Tensor, p: int) -> Tensor:
    """Which of the descending singular values span the dominant subspace: the first `p`, widened to
    every value tied with the `p`-th (a subspace that splits a tie is not defined, and ties are the
    rule for some classes: `Q − I` pairs its singular values per rotation plane, and every clamped
    `d_c = 0` of `diag_psd` has `|d_c − 1| = 1`), and never a zero singular value."""
    p_th = singular[..., min(p, singular.shape[-1]) - 1 : min(p, singular.shape[-1])]
    return (singular >= p_th * (1 - _TIE)) & (singular > _RCOND * singular[..., :1])


def _ridge_inverse(gram: Tensor, ridge: float) -> tuple[Tensor, Tensor, Tensor]:
    """`gram = W diag(g) Wᵀ`; returns `W`, `g` and `1/(g + λ)`, zero where `g + λ` is numerically
    zero (the minimum-norm solution when `λ = 0` and the data are rank-deficient)."""
    g, w = torch.linalg.eigh(gram)
    g = g.clamp_min(0)
    total = g + ridge
    cutoff = _RCOND * total.amax(dim=-1, keepdim=True)
    return w, g, torch.where(total > cutoff, 1 / total.where(total > cutoff, 1.0), 0.0)


def _float64(a: np.ndarray | Tensor, device: str | torch.device) -> Tensor:
    if isinstance(a, Tensor):
        return a.to(device=device, dtype=_F64)
    return torch.from_numpy(np.array(a, dtype=np.float64)).to(device)


def _fit_table(
    ids: dict[str, np.ndarray], k: int, metrics: dict[str, Tensor], patched: np.ndarray, n_nonfinite: int
) -> pa.Table:
    n, d = patched.shape
    schema = fit_schema(d)
    columns = {name: pa.array(values.astype(np.int32), pa.int32()) for name, values in ids.items()}
    columns["k"] = pa.array(np.full(n, k, dtype=np.int32))
    for name in METRICS:
        values = metrics[name].cpu().numpy()
        columns[name] = pa.array(values, pa.float64(), mask=np.isnan(values))
    columns["patched"] = pa.FixedSizeListArray.from_arrays(pa.array(patched.reshape(-1), pa.float32()), d)
    columns["n_nonfinite"] = pa.array(np.full(n, n_nonfinite, dtype=np.int32))
    return pa.Table.from_pydict(columns, schema=schema)
