"""The factorisations Study A's fits need, computed per device: each class keeps one definition of its math (in
its module) and asks `solver_for(device)` — the one dispatch — for what it factorises.

- `LAPACK`, the CPU's (and any device's without a batched path): torch.linalg's SVD and symmetric eigensolvers,
  one LAPACK call per matrix of a batch. On the CPU this is exactly what the fits always computed, bit for bit.
- `PRODUCTS`, CUDA's: batched matrix products (`bmm`) and batched Cholesky factorisations only. torch ≤ 2.11 runs a
  batched `svd` or `eigh` of matrices above 32 × 32 as one cuSOLVER call per matrix in a host loop (pytorch#175585,
  #174674), at 0.1 % of an H200's float64 rate (issue 38). Here:
  - the orthogonal polar factor of `C` by the scaled Newton–Schulz iteration `X ← X (a I + b XᵀX)` (`polar`), the
    sum and the smallest of `C`'s singular values from `H = QᵀC` (symmetric, with `C`'s singular values as its
    eigenvalues) — the products the Procrustes classes' identification reads;
  - the leading eigenvectors of a symmetric positive semi-definite matrix by block power iteration on its
    repeated squares and one Rayleigh–Ritz step (`top_eigenvectors`): the dominant subspaces;
  - a Gram matrix's rank at the float32 resolution and its smallest eigenvalue from a batched Cholesky of the
    shifted matrix and inverse iteration (`spectrum`): identification. A neighbourhood whose inputs lack full
    rank (rare at k > d) gets the exact eigendecomposition, alone.
  The selection of a dominant subspace (which singular values count, ties) is never here: both paths hand their
  singular values to `lmgeo.study_a.geometry`'s one rule.

`forced(PRODUCTS)` makes every device use the product path: the tests run it on the CPU against LAPACK.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

U32 = 2.0**-24  # float32 unit roundoff: the relative rounding of every stored activation value


class Polar(NamedTuple):
    """The polar decomposition `C = Q H` of each matrix of a batch (A, d, d): `rotation` Q, `singular_sum`
    Σ σᵢ(C) = tr H, `smallest` σ_min(C) (0 where `C` is numerically singular)."""

    rotation: Tensor
    singular_sum: Tensor
    smallest: Tensor


class GramSpectrum(NamedTuple):
    """What identification reads of a Gram matrix's eigenvalues λ (ascending, clamped at 0), per matrix: `trace`
    Σ λ, `kept` which λ exceed `U32² · trace` (the rank is their count), `smallest` λ_min and `smallest_kept` the
    smallest kept λ (inf where none is)."""

    trace: Tensor  # (A,)
    kept: Tensor  # (A, m) bool, ascending as λ
    smallest: Tensor  # (A,)
    smallest_kept: Tensor  # (A,)
    values: Tensor | None  # (A, m) every λ where the solver computed them (LAPACK), else None

    @property
    def rank(self) -> Tensor:
        return self.kept.sum(dim=-1)


class Lapack:
    """torch.linalg's factorisations, one LAPACK (or cuSOLVER) call per matrix."""

    name = "lapack"

    def polar(self, c: Tensor, floor: Tensor) -> Polar:
        del floor  # exact: every singular value counts
        svd = torch.linalg.svd(c)
        return Polar(svd.U @ svd.Vh, svd.S.sum(dim=1), svd.S[:, -1])

    def eigenvalues(self, gram: Tensor) -> Tensor:
        return torch.linalg.eigvalsh(gram).clamp_min(0)

    def spectrum(self, gram: Tensor) -> GramSpectrum:
        values = self.eigenvalues(gram)
        trace = values.sum(dim=-1)
        kept = values > U32**2 * trace[..., None]
        return GramSpectrum(trace, kept, values[..., 0], values.where(kept, torch.inf).amin(dim=-1), values)

    def top_eigenvectors(self, sym: Tensor, m: int) -> tuple[Tensor, Tensor]:
        """The `m` largest eigenvalues of each symmetric matrix (descending) and their eigenvectors."""
        values, vectors = torch.linalg.eigh(sym)
        return values.flip(-1)[..., :m], vectors.flip(-1)[..., :m]

    def normal_singular_vectors(self, normal: Tensor, symmetric: Tensor, m: int) -> Tensor:
        """Candidates for the leading `m` left singular vectors of each normal matrix `N` (A, d, d), given a
        symmetric matrix with the same eigenvectors as `N Nᵀ` (for `N = sQ − I`, `(Q + Qᵀ)/2`): here all of
        its eigenvectors, which the caller ranks by `‖N v‖` (more accurate than `N Nᵀ`'s small eigenvalues)."""
        del normal, m
        return torch.linalg.eigh(symmetric).eigenvectors

    def left_singular(self, core: Tensor) -> tuple[Tensor, Tensor]:
        """(U, S) of each matrix's thin SVD, singular values descending."""
        svd = torch.linalg.svd(core, full_matrices=False)
        return svd.U, svd.S


class Products(Lapack):
    """The same factorisations from batched products and batched Cholesky factorisations (see the module)."""

    name = "products"
    MAX_POLAR_STEPS = 80  # from the smallest floor (2⁻⁵²) the schedule needs 42 steps; from 1e-8, 24
    POLAR_TOLERANCE = 1e-14  # ‖XᵀX − I‖_F / √d at which a matrix is done
    OVERSAMPLING = 16  # block vectors beyond the m wanted: the iteration converges like (λ_{m+17} / λ_m)^(4t)
    MAX_BLOCK_STEPS = 200
    RESIDUAL_TOLERANCE = 1e-12  # ‖M v − λ v‖ / ‖M‖_F of every wanted Ritz pair at which the iteration stops
    INVERSE_STEPS = 20  # inverse iteration for a smallest eigenvalue: 1e-3 relative where λ₂/λ₁ is 1.2

    def polar(self, c: Tensor, floor: Tensor) -> Polar:
        """Scaled Newton–Schulz from `X₀ = C / ‖C‖_F`: with every singular value of `X` in `[ℓ, 1]`, the cubic
        `f(x) = (3x − x³)/2` applied to `α x` with `α = √(3 / (1 + ℓ + ℓ²))` maps `[ℓ, 1]` into `[f(αℓ), 1]`
        (`f(αℓ) = f(α)`: the optimal cubic step), so the lower end grows ~2.6× a step while small and converges
        quadratically near 1. Each matrix steps from its own `ℓ`: an estimate of `σ_min(C) / ‖C‖_F` (inverse
        iteration on `CᵀC`, halved) where that is above `floor` (A,), a lower bound on the singular values that
        must converge (an anchor whose smallest lies below it is unidentified anyway). A matrix is done when
        `‖XᵀX − I‖_F` is at rounding level, or when the same steps have provably brought every singular value
        above `floor` to 1 (tracked from `floor`: the step maps `[ℓ', 1]` into `[min(f(αℓ'), f(α)), 1]`)."""
        norm = torch.linalg.matrix_norm(c).clamp_min(torch.finfo(c.dtype).tiny)
        x = c / norm[:, None, None]
        eps = torch.finfo(c.dtype).eps
        bound = floor.to(c.dtype).clamp(min=eps, max=1.0)
        low = torch.maximum(bound, (self._smallest(x.mT @ x).sqrt() / 2).clamp(max=1.0))
        eye = torch.eye(c.shape[-1], dtype=c.dtype, device=c.device)
        tolerance = self.POLAR_TOLERANCE * c.shape[-1] ** 0.5
        for _ in range(self.MAX_POLAR_STEPS):
            gram = x.mT @ x
            done = (torch.linalg.matrix_norm(gram - eye) <= tolerance) | (bound >= 1 - 4 * eps)
            if bool(done.all()):
                break
            alpha = torch.where(done, torch.ones_like(low), torch.sqrt(3 / (1 + low + low**2)))
            # f(αX) = X (a I + b XᵀX) with a = 3α/2, b = −α³/2 (a finished matrix takes a plain step: it stays)
            x = x @ ((1.5 * alpha)[:, None, None] * eye - (0.5 * alpha**3)[:, None, None] * gram)
            low = _cubic(alpha, low).clamp(max=1.0)
            bound = torch.minimum(_cubic(alpha, bound), _cubic(alpha, torch.ones_like(bound))).clamp(max=1.0)
        h = x.mT @ c
        h = (h + h.mT) / 2
        return Polar(x, h.diagonal(dim1=-2, dim2=-1).sum(dim=-1), self._smallest(h))

    def spectrum(self, gram: Tensor) -> GramSpectrum:
        """Full rank (every eigenvalue above `U32² · trace`) where the Cholesky factorisation of `gram − U32² ·
        trace · I` exists; the smallest eigenvalue there by inverse iteration. Elsewhere every eigenvalue, by
        the exact solver, matrix by matrix (only those)."""
        trace = gram.diagonal(dim1=-2, dim2=-1).sum(dim=-1)
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        _, info = torch.linalg.cholesky_ex(gram - (U32**2 * trace)[:, None, None] * eye)
        full = info == 0
        kept = torch.ones(gram.shape[:-1], dtype=torch.bool, device=gram.device)
        smallest = self._smallest(gram)
        smallest_kept = smallest.clone()
        if not bool(full.all()):
            exact = super().spectrum(gram[~full])
            kept[~full], smallest[~full], smallest_kept[~full] = exact.kept, exact.smallest, exact.smallest_kept
        return GramSpectrum(trace, kept, smallest, smallest_kept, None)

    def top_eigenvectors(self, sym: Tensor, m: int) -> tuple[Tensor, Tensor]:
        """Subspace iteration with a Rayleigh–Ritz step each time, on `M⁴` (`M` normalised; the fourth power keeps
        every direction whose eigenvalue is above 1e-4 of the largest, and converges four times as fast), for a
        block of `m + OVERSAMPLING` vectors (at most the width) from a fixed start, until every wanted Ritz pair
        of `M` itself has a residual at rounding level. The Ritz problem is ≤ 32 × 32 at the study's `p`, a
        batched cuSOLVER call; the block is orthonormalised by Cholesky QR, twice."""
        d = sym.shape[-1]
        block = min(d, m + self.OVERSAMPLING)
        scale = torch.linalg.matrix_norm(sym).clamp_min(torch.finfo(sym.dtype).tiny)[:, None, None]
        step = sym / scale
        step = step @ step
        step = step @ step
        grid = torch.arange(d * block, dtype=sym.dtype, device=sym.device).reshape(d, block)
        basis = _orthonormal(torch.cos(grid * 0.7318) + torch.eye(d, block, dtype=sym.dtype, device=sym.device))
        basis = basis.expand(sym.shape[0], d, block)
        for _ in range(self.MAX_BLOCK_STEPS):
            basis = _orthonormal(step @ basis)
            ritz = basis.mT @ sym @ basis
            values, rotation = torch.linalg.eigh((ritz + ritz.mT) / 2)
            basis = basis @ rotation.flip(-1)  # descending
            values = values.flip(-1)
            wanted = basis[..., :m]
            residual = torch.linalg.vector_norm(sym @ wanted - wanted * values[:, None, :m], dim=-2)
            if bool((residual <= self.RESIDUAL_TOLERANCE * scale[:, 0]).all()):
                break
        return values[..., :m], basis[..., :m]

    def normal_singular_vectors(self, normal: Tensor, symmetric: Tensor, m: int) -> Tensor:
        """The leading `m` eigenvectors of `N Nᵀ` by `top_eigenvectors` (the caller ranks them by `‖N v‖`)."""
        del symmetric
        return self.top_eigenvectors(normal @ normal.mT, m)[1]

    def left_singular(self, core: Tensor) -> tuple[Tensor, Tensor]:
        """For matrices of at most 32 rows (a rank-r update, an MLP's hidden width), from the batched
        eigendecomposition of `core coreᵀ` (`σ = √λ`, descending); wider ones, by the SVD (one matrix: the
        layer's global subspace)."""
        if core.shape[-2] > 32:
            return super().left_singular(core)
        values, vectors = torch.linalg.eigh(core @ core.mT)
        return vectors.flip(-1), values.flip(-1).clamp_min(0).sqrt()

    def _smallest(self, spd: Tensor) -> Tensor:
        """The smallest eigenvalue of each symmetric positive semi-definite matrix by inverse iteration on its
        Cholesky factor (the Rayleigh quotient, an upper bound that converges from above); 0 where the
        factorisation does not exist (numerically singular)."""
        factor, info = torch.linalg.cholesky_ex(spd)
        v = torch.ones(spd.shape[:-1], dtype=spd.dtype, device=spd.device)[..., None]
        v = v + torch.linspace(0, 1, spd.shape[-1], dtype=spd.dtype, device=spd.device)[:, None]
        for _ in range(self.INVERSE_STEPS):
            v = torch.cholesky_solve(v, factor.where((info == 0)[:, None, None], _eye_like(spd)))
            v = v / torch.linalg.vector_norm(v, dim=-2, keepdim=True).clamp_min(torch.finfo(spd.dtype).tiny)
        quotient = (v.mT @ spd @ v)[..., 0, 0]
        return torch.where(info == 0, quotient.clamp_min(0), torch.zeros_like(quotient))


def _cubic(alpha: Tensor, x: Tensor) -> Tensor:
    """`f(αx)` with `f(x) = (3x − x³)/2`, elementwise: the Newton–Schulz step on a singular value."""
    return 1.5 * alpha * x - 0.5 * (alpha * x) ** 3


def _eye_like(batch: Tensor) -> Tensor:
    return torch.eye(batch.shape[-1], dtype=batch.dtype, device=batch.device).expand_as(batch)


def _orthonormal(block: Tensor) -> Tensor:
    """An orthonormal basis of each (d × b) block's columns, by Cholesky QR applied twice (the second pass
    restores orthogonality the first loses to rounding); a tiny shift keeps the Gram factorisable."""
    for _ in range(2):
        gram = block.mT @ block
        shift = 1e-14 * gram.diagonal(dim1=-2, dim2=-1).sum(dim=-1).clamp_min(torch.finfo(block.dtype).tiny)
        factor = torch.linalg.cholesky_ex(gram + shift[..., None, None] * _eye_like(gram)).L  # no sync to check
        block = torch.linalg.solve_triangular(factor.mT, block, upper=True, left=False)
    return block


LAPACK, PRODUCTS = Lapack(), Products()
_forced: Lapack | None = None


def solver_for(device: torch.device) -> Lapack:
    """The solver of `device`: the products on CUDA, LAPACK elsewhere (or whichever `forced` says)."""
    if _forced is not None:
        return _forced
    return PRODUCTS if device.type == "cuda" else LAPACK


@contextlib.contextmanager
def forced(solver: Lapack) -> Iterator[None]:
    """Every fit uses `solver` for the duration, whatever its device (the tests run the product path on the CPU)."""
    global _forced
    previous, _forced = _forced, solver
    try:
        yield
    finally:
        _forced = previous
