"""A straightforward per-anchor reference for the tokenwise fits of `pipeline.study_a.fits` (SPEC §4.2).

It works one anchor at a time in NumPy float64: its own neighbour search by fully sorting the
distances, its own least squares (`np.linalg.lstsq` on ridge-augmented systems), the full `d × d`
Jacobian of each fitted map (by autograd for the MLP) and its full SVD. It shares nothing with
`pipeline.study_a.fits` except the MLP's initial weights, which are part of that fit's definition.

Two users: `tests/test_fits.py` checks every column of `fit_layer` against it, and `lmgeo bench`
times `fit_layer` against it (SPEC §7: "fits vs a straightforward per-anchor reference").
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from pipeline.core.config import AnalysisConfig

Row = dict[str, Any]  # metric name -> float or None (undefined), and "patched" -> T_i(x_a)


def ref_distances(x: np.ndarray, a: int, distance: str, seq: np.ndarray | None = None) -> np.ndarray:
    """Distances from `x[a]` to every row, `inf` for `a` itself (and its sequence with `seq`)."""
    if distance == "euclidean":
        dist = np.sqrt(((x - x[a]) ** 2).sum(axis=1))
    else:
        dist = 1 - x @ x[a] / (np.linalg.norm(x, axis=1) * np.linalg.norm(x[a]))
    dist[a] = np.inf
    if seq is not None:
        dist[seq == seq[a]] = np.inf
    return dist


def ref_neighbours(
    x: np.ndarray, a: int, k: int, distance: str, seq: np.ndarray | None = None
) -> np.ndarray:
    """The `k` nearest rows of `x[a]`, never `a` itself (nor its sequence with `seq`); ties to the lower index."""
    dist = ref_distances(x, a, distance, seq)
    return np.argsort(dist, kind="stable")[:k]


def ridge_lstsq(
    inputs: np.ndarray, targets: np.ndarray, ridge: float, intercept: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """argmin ‖targets − [inputs, 1] W‖² + ridge ‖W_inputs‖², via lstsq on the augmented system."""
    n, d = inputs.shape
    design = np.hstack([inputs, np.ones((n, 1))]) if intercept else inputs
    penalty = np.sqrt(ridge) * np.eye(d, design.shape[1])
    aug_design = np.vstack([design, penalty])
    aug_targets = np.vstack([targets, np.zeros((d, targets.shape[1]))])
    return np.linalg.lstsq(aug_design, aug_targets, rcond=None)[0], aug_design


def ref_diag(xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig) -> tuple[np.ndarray, np.ndarray]:
    """One ridge regression per coordinate, clamped at 0: (T(x_a), J − I)."""
    coords = range(xn.shape[1])
    diag = np.array([max(0.0, ridge_lstsq(xn[:, [c]], yn[:, [c]], cfg.ridge)[0][0, 0]) for c in coords])
    return diag * xa, np.diag(diag) - np.eye(len(xa))


def ref_lowrank(xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig) -> tuple[np.ndarray, np.ndarray]:
    """Reduced-rank ridge regression of the updates: (T(x_a), J − I)."""
    b_t, aug_design = ridge_lstsq(xn, yn - xn, cfg.ridge)  # (d, d) = B̂ᵀ
    fitted = aug_design @ b_t  # rows: B̂ applied to [X, √λI]
    top = np.linalg.svd(fitted)[2][: cfg.rank].T  # left singular vectors of B̂[X, √λI]
    b = top @ top.T @ b_t.T
    return xa + b @ xa, b


def ref_orthogonal(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Procrustes pulled towards the identity, the full `d × d` polar factor: (T(x_a), J − I)."""
    cross = yn.T @ xn
    u, _, vt = np.linalg.svd(cross + cfg.ridge * np.eye(xn.shape[1]))
    q = u @ vt
    s = (cross * q).sum() / (xn * xn).sum() if cfg.orthogonal_scale else 1.0
    return s * q @ xa, s * q - np.eye(len(xa))


def ref_mlp(
    xn: np.ndarray, yn: np.ndarray, xa: np.ndarray, cfg: AnalysisConfig, w1_init: torch.Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """The MLP map fitted with Adam on this neighbourhood alone: (T(x_a), J − I) by autograd."""
    xt, yt, at = (torch.from_numpy(v) for v in (xn, yn, xa))
    d = xt.shape[1]
    mu = xt.mean(dim=0)
    sigma = ((xt - mu) ** 2).mean().sqrt()
    tau = ((yt - xt) ** 2).mean().sqrt()
    w1 = w1_init.clone().requires_grad_(True)
    b1 = torch.zeros(cfg.mlp_hidden, dtype=torch.float64, requires_grad=True)
    w2 = torch.zeros(d, cfg.mlp_hidden, dtype=torch.float64, requires_grad=True)
    b2 = torch.zeros(d, dtype=torch.float64, requires_grad=True)

    def t_map(v: torch.Tensor) -> torch.Tensor:
        return v + tau * (w2 @ torch.tanh(w1 @ ((v - mu) / sigma) + b1) + b2)

    opt = torch.optim.Adam([w1, b1, w2, b2], lr=1e-2)
    for _ in range(cfg.mlp_steps):
        opt.zero_grad()
        pred = torch.stack([t_map(v) for v in xt])
        loss = (((yt - pred) / tau) ** 2).mean() + cfg.ridge * ((w1**2).sum() + (w2**2).sum())
        loss.backward()
        opt.step()
    with torch.no_grad():
        t_val = t_map(at)
    jac = torch.autograd.functional.jacobian(t_map, at)
    return t_val.numpy(), jac.numpy() - np.eye(d)


def top_subspace(u: np.ndarray, s: np.ndarray, p: int) -> np.ndarray | None:
    """Columns of `u` for the top-`p` singular values, ties with the `p`-th included, zeros never."""
    if s[0] <= 0:
        return None
    p_th = s[min(p, len(s)) - 1]
    return u[:, : len(s)][:, (s >= p_th * (1 - 1e-8)) & (s > 1e-12 * s[0])]


def energy(v: np.ndarray, basis: np.ndarray | None) -> float | None:
    if basis is None or np.linalg.norm(v) == 0:
        return None
    return float(np.sum((basis.T @ v) ** 2) / np.sum(v**2))


def ratio(num: float, den: float) -> float | None:
    return None if den == 0 else num / den


def reference_rows(
    x: np.ndarray, y: np.ndarray, seq: np.ndarray, anchors: np.ndarray, fn: str, cfg: AnalysisConfig
) -> list[Row]:
    """One anchor at a time: T_i(x_a) and J_i − I, then every metric column (None where undefined)."""
    if fn == "global_linear":
        coef = ridge_lstsq(x, y, cfg.ridge, intercept=True)[0]
        a_mat, b_vec = coef[:-1].T, coef[-1]
    if fn == "mlp":
        gen = torch.Generator().manual_seed(cfg.seed)
        w1_all = torch.randn((len(anchors), cfg.mlp_hidden, x.shape[1]), generator=gen, dtype=torch.float64)
        w1_all /= math.sqrt(x.shape[1])
    patched, ops = [], []
    for i, a in enumerate(anchors):
        xa = x[a]
        if fn == "identity":
            t_val, op = xa.copy(), np.zeros((len(xa), len(xa)))
        elif fn == "global_linear":
            t_val, op = a_mat @ xa + b_vec, a_mat - np.eye(len(xa))
        else:
            nb = ref_neighbours(x, a, cfg.k, cfg.distance, seq if cfg.exclude_same_sequence else None)
            if fn == "mlp":
                t_val, op = ref_mlp(x[nb], y[nb], xa, cfg, w1_all[i])
            else:
                ref_fit = {"diag_psd": ref_diag, "lowrank": ref_lowrank, "orthogonal": ref_orthogonal}[fn]
                t_val, op = ref_fit(x[nb], y[nb], xa, cfg)
        patched.append(t_val)
        ops.append(op)
    tok_all = np.array(patched) - x[anchors]
    _, s, vt = np.linalg.svd(tok_all)
    global_basis = top_subspace(vt.T, s, cfg.p)
    rows = []
    for a, t_val, op in zip(anchors, patched, ops):
        full, tok, res = y[a] - x[a], t_val - x[a], y[a] - t_val
        nf, nt, nr = (np.linalg.norm(v) for v in (full, tok, res))
        u, s, _ = np.linalg.svd(op)
        local = top_subspace(u, s, cfg.p)
        cos_rt = ratio(res @ tok, nr * nt)
        rows.append(
            {
                "rel_err": ratio(nr, nf),
                "rel_err_state": ratio(nr, np.linalg.norm(y[a])),
                "cos_full_tok": ratio(abs(full @ tok), nf * nt),
                "cos_full_res": ratio(abs(full @ res), nf * nr),
                "angle_res_tok": None if cos_rt is None else math.degrees(math.acos(np.clip(cos_rt, -1, 1))),
                "proj_full": energy(full, local),
                "proj_res": energy(res, local),
                "proj_full_global": energy(full, global_basis),
                "proj_res_global": energy(res, global_basis),
                "norm_full": nf,
                "norm_res": nr,
                "patched": t_val,
            }
        )
    return rows
