"""The equidistance step of `hilbert_equi` as the solver of a stated problem (SPEC §3.2).

**The problem** (the Study B paper's: spread the update's rows as evenly as possible within the Hilbert
budget, with a descent condition). For the head momentum `M` (V × d), its centred rows `g_i`, `S = Σ_i ‖g_i‖`,
a budget η and a share `c ∈ (0, 1]`:

    maximise    min_{i≠j} ‖x_i − x_j‖
    over        X ∈ R^{V×d} whose rows have a common norm
    subject to  diam(X) ≤ η   and   ⟨G, X⟩ ≥ c · (η/2) · S,

the last being *at least c of the descent of `hilbert`'s step at the same budget* (`hilbert` puts the rows at
`(η/2)·ĝ_i`, descent `(η/2)·S`). Both sides scale with X, so the problem is scale-free: maximise the
spread `ρ(X) = min_{i≠j} ‖x_i − x_j‖ / diam(X)` subject to the descent per unit diameter
`A(X) = ⟨G, X⟩ / (½·diam(X)·S) ≥ c` (`head_alignment_hilbert`, SPEC §3.3), then scale to diam = η; that is
what `solve` does, on unit rows. Common row norms are the geometry of `hilbert`'s step (every token's
logit moves by the same radius); the free problem (rows of any norm) reaches 1–5 % more spread at V ≤ 16,
d ≤ 4 (`tests/test_equidistance.py` measures both).

**The solver**: ascent on the spread, projected on the descent condition, from `hilbert`'s step.
- Candidates: each row's `NEAR` nearest rows and `FAR` farthest rows, exactly from the Gram matrix up to
  `BUCKET_ROWS` rows. Above, the nearest rows within buckets of about `BUCKET_ROWS` rows of a random
  projection tree (balanced by medians, vectorised), compared on a width-`SKETCH_WIDTH` Gaussian sketch
  when d is wider; no farthest rows, and diam ≤ 2 (unit rows) is the certified diameter.
- Each iteration: soft-min of the candidate distances (temperature relative to the smallest, sharpened
  from `KAPPA` to `KAPPA_END` over a cold solve), soft-max of the far ones; each row takes a step of fixed
  angle along the tangent part of its (momentum-averaged) ascent direction, is renormalised, and all rows
  are projected on the descent condition (`lift`: the Euclidean projection on the product of spheres,
  `u_i ∝ y_i + λ·g_i` with one λ ≥ 0 found by bisection). Up to `BUCKET_ROWS` rows the iterations hold
  c·(1 + `MARGIN`) (their diameter is the candidates', a lower bound), and every candidate search checks the
  rows against c with their exact diameter: the best feasible iterate is kept.
- The end: the last rows lifted with their exact diameter until A ≥ c (`FEASIBILITY_ROUNDS`), or the best
  feasible iterate if it spreads its rows more. A lift at the sphere's bound 2 (which sends the rows back
  towards hilbert's) only when neither is feasible.
- A cold solve (no previous rows) takes `iters` iterations with a decaying angle and, where V·d ≤
  `MULTISTART_SIZE`, `STARTS` starts (the best is kept: it costs less than one start at the study's size);
  a warm solve (the previous step's rows, as the optimizer passes them) takes `iters` iterations at the final
  angle and temperature, so over training the iterations accumulate while the momentum drifts.

Deterministic for given inputs: the starts' noise comes from a fixed seed, ties are broken by index, and
nothing depends on a generator's state. Every operation is a tensor operation (Python loops run over chunks
of rows, never over single rows or buckets), so the same code runs on a GPU. The iterations' V × d products
and (V, k, d) candidate differences are formed a chunk of rows at a time (`CHUNK_BYTES`) in one reused
buffer: on a CPU a fresh V × d tensor costs ~10× an in-place pass over it (the page faults of a new
mapping), and a chunk stays in cache between the operations applied to it. Each chunk computes, row by row,
what the whole-tensor operation computes, so the chunk size changes no bit of the step (tested).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from lmgeo.study_b.hilbert import center_rows
from lmgeo.study_b.lmo import sketch, sketch_projection, unit_rows, unit_rows_

NEAR = 8  # nearest-row candidates per row
FAR = 4  # farthest-row candidates per row (exact search only)
BUCKET_ROWS = 2048  # exact candidate search up to this many rows; buckets of about this size above
# A chunk's buffer: small enough to stay in a CPU's cache between the operations on it, large enough that
# per-operation overheads do not dominate; a GPU reuses its freed memory without page faults and pays a
# launch per operation, so it takes larger chunks (memory still bounded).
CHUNK_BYTES, GPU_CHUNK_BYTES = 2**20, 2**27
REFRESH = 10  # iterations between candidate searches (and one at the start of every solve)
KAPPA, KAPPA_END = 80.0, 400.0  # soft-min/soft-max sharpness, relative to the smallest/largest distance
# The per-iteration step of every row (radians): a cold solve decays it linearly from ANGLE to ANGLE_END (a
# fine last polish: the rows end within ~ANGLE_END of their optimum); a warm solve tracks at WARM_ANGLE. In
# training each step's projection on the new momentum's descent condition pulls the rows together again, and
# the warm solve must undo it: at 0.005 rad (× 5 iterations) it could not, and the study's hilbert_equi steps
# spread their rows less than random rows do (0.30 against 0.54; a cold solve of the same momentum: 0.74).
ANGLE, ANGLE_END, WARM_ANGLE = 0.1, 0.001, 0.05
VELOCITY = 0.5  # momentum of the ascent direction
# A row steps the full angle when its push is at least this share of the strongest row's, proportionally less
# below: rows far from the smallest distances barely move (they would only spend descent).
STEP_FLOOR = 0.1
STARTS, MULTISTART_SIZE = 8, 4096  # cold starts where V·d is at most MULTISTART_SIZE
START_SPREADS = (1.0, 0.3)  # noise of the starts around hilbert's rows (relative to a unit row)
LIFT_BISECTIONS = 32  # μ to 2^-32: the descent condition to ~1e-9, below its 1e-6 margin
FEASIBILITY_ROUNDS = 3
# Up to BUCKET_ROWS rows the iterations hold the descent condition at c·(1 + MARGIN) with the candidates'
# diameter, a lower bound of the exact one: held at c itself, they ended just short of it (A/c ≈ 0.9998), each
# exact lift widened the diameter, and the rounds did not settle.
MARGIN = 1e-3
_SEED = 0  # the starts' noise and the tree's directions: fixed, so the step is a function of its inputs


# ------------------------------------------------------------------------------------------- row chunks
def _chunks(like: Tensor, *shape: int) -> Iterator[tuple[slice, Tensor]]:
    """Slices of `like`'s rows, a chunk at a time, each with a scratch buffer of `(rows, *shape)` (`like`'s row
    shape by default; one buffer, reused: its contents do not survive the next chunk)."""
    shape = shape or tuple(like.shape[1:])
    n_rows = like.shape[0]
    budget = GPU_CHUNK_BYTES if like.device.type == "cuda" else CHUNK_BYTES
    chunk = max(1, budget // (like.element_size() * math.prod(shape)))
    buffer = like.new_empty(min(chunk, n_rows), *shape)
    for start in range(0, n_rows, chunk):
        stop = min(start + chunk, n_rows)
        yield slice(start, stop), buffer[: stop - start]


def row_dots(a: Tensor, b: Tensor) -> Tensor:
    """(V,) `(a * b).sum(1)`, the same sums, without its V × d temporary."""
    dots = a.new_empty(a.shape[0])
    for rows, scratch in _chunks(a):
        torch.sum(torch.mul(a[rows], b[rows], out=scratch), 1, out=dots[rows])
    return dots


# ---------------------------------------------------------------------------------- the descent condition
class Gradient(NamedTuple):
    """The rows G the descent condition is stated for, and the row sums every lift reads (once per solve)."""

    rows: Tensor
    norms: Tensor  # ‖g_i‖
    squares: Tensor  # ‖g_i‖², float64 (the lift's bisection)

    @classmethod
    def of(cls, g: Tensor) -> Gradient:
        return cls(g, g.norm(dim=1), row_dots(g, g).to(torch.float64))


def descent_target(grad: Gradient, alignment: float, diameter: Tensor) -> Tensor:
    """`⟨G, U⟩` that unit rows of diameter `diameter` need: `c · S · diameter / 2` (A(U) ≥ c)."""
    return alignment * grad.norms.sum() * diameter / 2


def lift_(u: Tensor, grad: Gradient, target: Tensor) -> Tensor:
    """`u` moved, in place, to the nearest unit rows (Euclidean, row by row on the product of spheres) with
    ⟨G, U⟩ ≥ `target`: `unit(u_i + λ·g_i)` with the smallest λ ≥ 0 that reaches it, by bisection on per-row
    scalars (λ = s·μ/(1 − μ), μ ∈ [0, 1], s the inverse mean row norm of G; ⟨g_i, u_i(λ)⟩ grows with λ, to
    ‖g_i‖). Feasible whenever target ≤ S; rows are left as they are when already feasible. No host sync."""
    exact = torch.float64
    g = grad.rows
    scale = 1.0 / grad.norms.mean().clamp_min(torch.finfo(g.dtype).tiny)
    uu, ug, gg = row_dots(u, u).to(exact), row_dots(u, g).to(exact), grad.squares
    goal = target.to(exact) * (1 + 1e-6) + 1e-30  # float rounding of the rows must not undo it

    def reached(mu: Tensor) -> Tensor:
        a, b = 1 - mu, mu * scale
        norm = (a * a * uu + 2 * a * b * ug + b * b * gg).clamp_min(1e-300).sqrt()
        return ((a * ug + b * gg) / norm).sum()

    low, high = torch.zeros((), dtype=exact, device=u.device), torch.ones((), dtype=exact, device=u.device)
    for _ in range(LIFT_BISECTIONS):
        middle = (low + high) / 2
        short = reached(middle) < goal
        low, high = torch.where(short, middle, low), torch.where(short, high, middle)
    mu = torch.where(reached(low.new_zeros(())) >= goal, low.new_zeros(()), high).to(u.dtype)
    for rows, scratch in _chunks(u):
        u[rows].mul_(1 - mu).add_(torch.mul(g[rows], mu * scale, out=scratch))
    return unit_rows_(u)


# ------------------------------------------------------------------------------------------- candidates
class Candidates(NamedTuple):
    near: Tensor  # (V, ≤ NEAR) indices of each row's nearest rows
    far: Tensor | None  # (V, ≤ FAR) its farthest rows; None above BUCKET_ROWS (diam ≤ 2 is used)


class Solution(NamedTuple):
    """Unit rows, their certified diameter (exact to float32 rounding, or the sphere's 2 above `BUCKET_ROWS`
    rows), and their candidates (a warm start's first search)."""

    rows: Tensor
    diameter: Tensor
    found: Candidates


def search(u: Tensor, projection: Tensor | None) -> tuple[Candidates, Tensor]:
    """Each unit row's nearest (and, up to `BUCKET_ROWS` rows, farthest) other rows, and the rows' diameter
    from the same Gram matrix — an upper bound, its float32 rounding added — or above `BUCKET_ROWS` the
    nearest within buckets and the sphere's bound 2."""
    n_rows, width = u.shape
    if n_rows > BUCKET_ROWS:
        return Candidates(bucketed_nearest(sketch(u, projection), NEAR), None), u.new_tensor(2.0)
    similarity = u @ u.T
    rounding = 4 * (width + 2) * torch.finfo(u.dtype).eps  # of an inner product of (nearly) unit rows
    diameter = (2 - 2 * similarity.min() + rounding).clamp_min(0).sqrt()
    own = torch.arange(n_rows, device=u.device)
    similarity[own, own] = -math.inf
    near = similarity.topk(min(NEAR, n_rows - 1), dim=1).indices
    similarity[own, own] = math.inf
    far = similarity.topk(min(FAR, n_rows - 1), dim=1, largest=False).indices
    return Candidates(near, far), diameter


def bucketed_nearest(s: Tensor, k: int) -> Tensor:
    """(V, k) each row's k nearest rows (largest inner products) within its bucket of a random projection
    tree: L levels split every group at its median along a fixed random direction, so the 2^L buckets hold
    ⌈V / 2^L⌉ slots each (padding slots are never chosen). Vectorised: a sort per level, one batched
    Gram for all buckets."""
    n_rows, width = s.shape
    levels = max(0, math.ceil(math.log2(n_rows / BUCKET_ROWS)))
    groups = 2**levels
    size = math.ceil(n_rows / groups)
    padded = groups * size
    directions = torch.randn(levels, width, generator=torch.Generator().manual_seed(_SEED)).to(s.device, s.dtype)
    slots = torch.arange(padded, device=s.device)  # slot -> row (rows ≥ n_rows are padding)
    for level in range(levels):
        key = torch.full((padded,), math.inf, dtype=s.dtype, device=s.device)
        real = slots < n_rows
        key[real] = s[slots[real]] @ directions[level]
        order = torch.argsort(key.view(2**level, -1), dim=1, stable=True)
        slots = slots.view(2**level, -1).gather(1, order).flatten()
    members = slots.view(groups, size)
    valid = members < n_rows
    vectors = s[members.clamp(max=n_rows - 1)] * valid[..., None]
    similarity = torch.bmm(vectors, vectors.transpose(1, 2))
    excluded = ~valid[:, None, :] | torch.eye(size, dtype=torch.bool, device=s.device)[None]
    similarity.masked_fill_(excluded, -math.inf)
    take = min(k, size - 1)
    found = members.gather(1, similarity.topk(take, dim=2).indices.flatten(1)).view(groups, size, take)
    nearest = torch.empty(n_rows, take, dtype=torch.long, device=s.device)
    nearest[members[valid]] = found[valid]
    return nearest


# ---------------------------------------------------------------------------------------- the iterations
def _pair_lengths(u: Tensor, index: Tensor) -> Tensor:
    """(V, k) ‖u_i − u_{index_ij}‖: each chunk's candidates gathered into the buffer and differenced there."""
    lengths = u.new_empty(index.shape)
    for rows, pairs in _chunks(u, index.shape[1], u.shape[1]):
        torch.index_select(u, 0, index[rows].flatten(), out=pairs.view(-1, u.shape[1]))
        torch.linalg.vector_norm(pairs.sub_(u[rows, None]), dim=2, out=lengths[rows])
    return lengths


def _pull(u: Tensor, index: Tensor, weights: Tensor) -> Tensor:
    """Σ_j weights_ij · (u_i − u_{index_ij}) per row, without a (V, k, d) temporary."""
    pulled = torch.nn.functional.embedding_bag(index, u, per_sample_weights=weights, mode="sum")
    total = weights.sum(1, keepdim=True)
    for rows, scratch in _chunks(u):
        torch.sub(torch.mul(u[rows], total[rows], out=scratch), pulled[rows], out=pulled[rows])
    return pulled


def _ascent(u: Tensor, found: Candidates, kappa: float) -> tuple[Tensor, Tensor]:
    """The ascent direction of log(soft-min of the near distances) − log(soft-max of the far ones), per row
    (each row's own pairs), and the far candidates' largest distance (2 when there are none)."""
    tiny = torch.finfo(u.dtype).tiny
    lengths = _pair_lengths(u, found.near).clamp_min(tiny)
    smallest = lengths.min()
    weights = torch.softmax((-kappa * lengths / smallest).flatten(), 0).view_as(lengths)
    direction = _pull(u, found.near, weights / lengths).div_(smallest)
    if found.far is None:
        return direction, u.new_tensor(2.0)
    far = _pair_lengths(u, found.far).clamp_min(tiny)
    largest = far.max()
    weights = torch.softmax((kappa * far / largest).flatten(), 0).view_as(far)
    return direction.sub_(_pull(u, found.far, weights / far).div_(largest)), largest


def _diameter(u: Tensor, found: Candidates) -> Tensor:
    return u.new_tensor(2.0) if found.far is None else _pair_lengths(u, found.far).max()


def _iterate(
    u: Tensor, grad: Gradient, alignment: float, iters: int, cold: bool, projection: Tensor | None, found: Candidates
) -> tuple[Tensor, tuple[Tensor, Solution] | None]:
    """`iters` iterations from `u`, which they update in place (the caller's own rows), and the best feasible
    iterate seen at their candidate searches, with its spread (exact search only: its Gram matrix gives the
    certified diameter, so the check is free; a copy of the rows), or None."""
    velocity = torch.zeros_like(u)
    tiny = torch.finfo(u.dtype).tiny
    held = alignment * (1 + MARGIN) if found.far is not None else alignment
    best: tuple[Tensor, Solution] | None = None
    for it in range(iters):
        if it and it % REFRESH == 0:
            found, diameter = search(u, projection)
            best = _better(best, u, grad, alignment, found, diameter)
        progress = it / iters
        kappa = KAPPA * (KAPPA_END / KAPPA) ** progress if cold else KAPPA_END
        angle = ANGLE * (1 - progress) + ANGLE_END * progress if cold else WARM_ANGLE
        direction, _ = _ascent(u, found, kappa)
        radial = row_dots(direction, u)[:, None]
        for rows, scratch in _chunks(u):  # along the sphere
            direction[rows].sub_(torch.mul(radial[rows], u[rows], out=scratch))
        velocity.mul_(VELOCITY).add_(direction, alpha=1 - VELOCITY)
        push = velocity.norm(dim=1, keepdim=True)
        step = torch.maximum(push, STEP_FLOOR * push.max()).clamp_min(tiny)
        for rows, scratch in _chunks(u):
            u[rows].add_(torch.mul(velocity[rows], angle, out=scratch).div_(step[rows]))
        lift_(unit_rows_(u), grad, descent_target(grad, held, _diameter(u, found)))
    return u, best


def _starts(g: Tensor) -> list[Tensor]:
    """Unit rows around hilbert's (g_i/‖g_i‖), with fixed noise: one start, or STARTS on small problems."""
    n_rows, width = g.shape
    count = STARTS if n_rows * width <= MULTISTART_SIZE else 1
    gen = torch.Generator().manual_seed(_SEED)
    axes = unit_rows(g)
    noise = [unit_rows(torch.randn(n_rows, width, generator=gen, dtype=torch.float64)) for _ in range(count)]
    return [
        unit_rows_(axes + START_SPREADS[i % len(START_SPREADS)] * n.to(g.device, g.dtype)) for i, n in enumerate(noise)
    ]


def spread(u: Tensor) -> Tensor:
    """ρ(U) = min/max pairwise distance of the rows (exact; for the solver's choice among starts)."""
    distances = torch.pdist(u.to(torch.float64))
    return distances.min() / distances.max()


def _better(best: tuple[Tensor, Solution] | None, u: Tensor, grad: Gradient, alignment: float,
            found: Candidates, diameter: Tensor) -> tuple[Tensor, Solution] | None:  # fmt: skip
    """`best` (its spread and solution), or `u` copied when it meets A ≥ c with its certified `diameter` and
    spreads its rows more (the nearest candidates' smallest distance over the diameter; exact search only)."""
    if found.far is None or bool((grad.rows * u).sum() < descent_target(grad, alignment, diameter)):
        return best
    rho = _pair_lengths(u, found.near[:, :1]).min() / diameter
    if best is not None and not bool(rho > best[0]):
        return best
    return rho, Solution(u.clone(), diameter, found)


def feasible(u: Tensor, grad: Gradient, alignment: float, projection: Tensor | None,
             kept: tuple[Tensor, Solution] | None = None) -> Solution:  # fmt: skip
    """The better of `kept` (the best feasible iterate, from `_iterate`) and `u` (the caller's own rows) lifted
    until A ≥ c holds with its certified diameter (the iterations used the candidates'): each lift moves the
    diameter, so the rows are searched again; the lifts hold c·(1 + MARGIN), so one usually settles it. Only when
    neither `u` nor an iterate meets the condition does a last lift with the sphere's bound 2 settle it (it
    sends the rows back towards hilbert's). Above BUCKET_ROWS the diameter is the sphere's 2 throughout."""
    found, diameter = search(u, projection)
    for _ in range(FEASIBILITY_ROUNDS):
        if bool((grad.rows * u).sum() >= descent_target(grad, alignment, diameter)):
            if found.far is None:  # the sphere's bound: no iterate is kept, and no exact spread to compare
                return Solution(u, diameter, found)
            break
        lift_(u, grad, descent_target(grad, alignment * (1 + MARGIN), diameter))
        found, diameter = search(u, projection)
    kept = _better(kept, u, grad, alignment, found, diameter)
    if kept is not None:
        return kept[1]
    lift_(u, grad, descent_target(grad, alignment, u.new_tensor(2.0)))
    found, diameter = search(u, projection)
    return Solution(u, diameter, found)


def solve(m: Tensor, alignment: float, iters: int, start: Solution | None = None) -> Solution:
    """Unit rows maximising the spread subject to A ≥ `alignment` (the problem above), for the momentum
    `m`: `iters` iterations from `start` (warm: the previous step's solution, same shape), or a cold solve
    from hilbert's rows (several starts on small problems, the best spread kept)."""
    if not 0 < alignment <= 1:
        raise ValueError(f"the descent share must be in (0, 1], got {alignment}")
    grad = Gradient.of(center_rows(m))
    projection = sketch_projection(m.shape[1], m) if m.shape[0] > BUCKET_ROWS else None
    if start is not None and start.rows.shape == m.shape:
        u = lift_(start.rows.clone(), grad, descent_target(grad, alignment, start.diameter))
        rows, seen = _iterate(u, grad, alignment, iters, False, projection, start.found)
        return feasible(rows, grad, alignment, projection, seen)
    best: Solution | None = None
    for u in _starts(grad.rows):
        found, diameter = search(u, projection)
        lift_(u, grad, descent_target(grad, alignment, diameter))
        rows, seen = _iterate(u, grad, alignment, iters, True, projection, found)
        solution = feasible(rows, grad, alignment, projection, seen)
        if best is None or bool(spread(solution.rows) > spread(best.rows)):  # several starts: small problems only
            best = solution
    assert best is not None
    return best
