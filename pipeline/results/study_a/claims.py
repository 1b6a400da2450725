"""Study A's claims as tests against nulls (SPEC §4.4, §4.5).

Each claim of the seed is a statistic of a (model, layer, class) stratum's anchors and a *null*: the same
statistic on a null sample (the fits on `shuffled` pairs, on the `gaussian` pool), on a null patch
(`kl_random`, the mean over several random directions, `kl_other`), or zero where the statistic is itself an
effect. The effect is statistic − null, signed so that positive is the claim's direction.

Intervals are seed-level: a subject (`<arch>@<checkpoint>`) has one model per trained seed, and its
interval comes from a two-stage bootstrap — resample the seeds, then each drawn seed's anchors (paired: an
anchor is drawn with its real and its null values) — so a claim that holds on one seed and not the next gets
a wide interval. A model's effect over layers is the mean of its layers' effects (each layer resampled on its
own, never rows of different layers ranked together); the subject's is the mean over its seeds.

Readings of an effect e with interval [lo, hi], the claim's margin m (the smallest effect worth the name)
and one-sided bootstrap p-values, Holm-adjusted over the tests a summary cell combines (its classes and
nulls): **supported** when e > 0 beyond chance (adjusted p) and e ≥ m; **contradicted** when e < 0 beyond
chance (the interval on the wrong side of 0); **not supported** when e > 0 beyond chance but hi < m (an
effect, too small to count); **inconclusive** otherwise. A stratum with fewer than `MIN_ANCHORS` complete
anchors is left out. `global_linear` and the layer-wide fits of the local classes (`<class>.layer`) are
baselines: their rows are tested, but a claim's summary is over the local classes only.

The expressivity trade-off is a claim across classes (`fn` = `ACROSS`): per layer, on the anchors every local
tokenwise class keeps, each class's median rel_err and Spearman(rel_err, kl) are ranked against the classes'
capacity (`FitClass.parameters`); its effect is −Spearman(capacity, value), so positive is "falls with
capacity". Besides the bootstrap, its null is the capacity order permuted (the same permutation for every layer
and seed): its one-sided p is the larger of the two, so an ordering of few classes that chance could produce
is never supported.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.core.contracts import parse_run_id
from pipeline.results.stats import holm, spearman_of_draws, spearman_rows
from pipeline.study_a.classes import FIT_CLASSES

MIN_ANCHORS = 10
SUPPORTED, NOT_SUPPORTED, CONTRADICTED, INCONCLUSIVE = "supported", "not supported", "contradicted", "inconclusive"
LAYER_FIT = ".layer"  # `<class>.layer`: the local class fitted once for the whole layer (the locality baseline)
ACROSS = "by capacity"  # the `fn` of a stratum across the local tokenwise classes (the expressivity trade-off)

Columns = dict[str, np.ndarray]  # one stratum's per-anchor values: "<column>" real, "<sample>.<column>" null
Statistic = Callable[[Columns, np.ndarray], np.ndarray]  # (columns, index rows (B, n)) -> (B,) statistics


def _median(column: str) -> Statistic:
    return lambda c, idx: np.median(c[column][idx], axis=-1)


def _median_difference(a: str, b: str) -> Statistic:
    return lambda c, idx: np.median(c[a][idx] - c[b][idx], axis=-1)


def _spearman(x: str, y: str) -> Statistic:
    return lambda c, idx: spearman_of_draws(c[x], c[y], idx)


def _partial_spearman(x: str, y: str, z: str) -> Statistic:
    """Spearman of x and y with z partialled out: the partial correlation of the ranks."""

    def stat(c: Columns, idx: np.ndarray) -> np.ndarray:
        xy, xz, yz = (spearman_of_draws(c[a], c[b], idx) for a, b in ((x, y), (x, z), (y, z)))
        with np.errstate(invalid="ignore", divide="ignore"):
            return (xy - xz * yz) / np.sqrt((1 - xz**2) * (1 - yz**2))

    return stat


def _median_acute(column: str) -> Statistic:
    """The median acute angle between the lines of two vectors, 90° − |90° − angle|: near 90° exactly when
    they are near orthogonal, whichever way each points."""
    return lambda c, idx: np.median(90.0 - np.abs(90.0 - c[column][idx]), axis=-1)


def _median_log_ratio(a: str, b: str) -> Statistic:
    return lambda c, idx: np.median(np.log(c[a][idx] / c[b][idx]), axis=-1)


@dataclass(frozen=True)
class Test:
    """One null of a claim: the statistic on the real values, the same on the null (None: zero, the
    statistic being an effect itself), and every column the two read."""

    statistic: Statistic
    null: Statistic | None
    columns: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    name: str
    text: str  # the seed's claim, as tested here
    tests: dict[str, Test]  # null name -> test
    margin: float  # the smallest effect that counts
    seed_value: str  # what the seed reports, for the reader
    # "tokenwise" (every class but identity), "local", or "across" (one stratum over the local tokenwise classes)
    classes: str = "tokenwise"
    # For a newcomer (the report's summary): the claim as one plain sentence, and as a row label of a few words
    # (the heat map's rows, the detail table's). Every claim has both (tests/test_report.py).
    plain: str = ""
    label: str = ""


def _geometric(name: str, text: str, columns: tuple[str, ...], margin: float, seed_value: str, plain: str,
               label: str, of_one: Callable[[str], Statistic] = _median) -> Claim:  # fmt: skip
    """A median (`of_one` column, or of the difference of two) against the same on each null sample."""

    def stat(prefix: str) -> Statistic:
        names = [prefix + c for c in columns]
        return of_one(names[0]) if len(names) == 1 else _median_difference(*names)

    tests = {
        sample: Test(stat(""), stat(f"{sample}."), columns + tuple(f"{sample}.{c}" for c in columns))
        for sample in ("shuffled", "gaussian")
    }
    return Claim(name, text, tests, margin, seed_value, plain=plain, label=label)


def _patch(null: str) -> str:
    return f"kl_{null}"


CLAIMS: tuple[Claim, ...] = (
    _geometric("cos_full_tok_near_1", "the full update is aligned with its tokenwise part (median cos_full_tok)",
               ("cos_full_tok",), 0.05, "near 1",
               "A layer's update points where its tokenwise part points, more than on shuffled or random inputs.",
               "update along tokenwise part"),
    _geometric("angle_res_tok_near_90", "the residual is closer to orthogonal to the tokenwise part than the "
               "null's (median acute angle 90° − |90° − angle_res_tok|)", ("angle_res_tok",), 5.0, "often > 60°",
               "What the tokenwise part misses (the residual) is closer to orthogonal to it than by chance.",
               "residual orthogonal to it", _median_acute),
    _geometric("proj_res_below_full", "the residual projects less than the full update on the dominant local "
               "tokenwise subspace (median proj_full − proj_res)", ("proj_full", "proj_res"), 0.05,
               "significantly lower",
               "The residual lies less in the neighbourhood's main tokenwise directions than the update does.",
               "residual off local subspace"),
    _geometric("proj_res_global_below_full", "the same on the layer's global tokenwise subspace "
               "(median proj_full_global − proj_res_global)", ("proj_full_global", "proj_res_global"), 0.05,
               "significantly lower", "The same for the layer's main tokenwise directions.",
               "residual off layer subspace"),
    Claim("spearman_rel_err_kl", "the residual's size predicts the output change: Spearman(rel_err, kl) against "
          "Spearman(rel_err, kl of a null patch of the same norm)",
          {null: Test(_spearman("rel_err", "kl"), _spearman("rel_err", _patch(null)), ("rel_err", "kl", _patch(null)))
           for null in ("random", "other")}, 0.1, "> 0.7, up to 0.95",
          plain="The bigger the residual, the more removing it changes the output, more so than for a patch of the "
          "same size in another direction.", label="residual size → output change"),
    Claim("partial_spearman_rel_err_kl", "the same with the residual's size relative to the state (rel_err_state) "
          "partialled out: partial Spearman(rel_err, kl | rel_err_state), against 0",
          {"zero": Test(_partial_spearman("rel_err", "kl", "rel_err_state"), None, ("rel_err", "kl", "rel_err_state"))},
          0.1, "(not reported)", plain="The same, once the residual's size relative to the hidden state is "
          "accounted for.", label="… beyond its relative size"),
    Claim("residual_outweighs_null", "removing the real residual moves the output more than removing a null "
          "residual of the same norm: median log(kl / kl_null), against 0",
          {null: Test(_median_log_ratio("kl", _patch(null)), None, ("kl", _patch(null)))
           for null in ("random", "other")},
          math.log(1.25), "the residual is functionally decisive",
          plain="Removing the residual changes the output at least 25% more than removing a patch of the same size "
          "in another direction.", label="residual moves the output"),
    Claim("local_beats_layer", "a local class explains more fitted per neighbourhood than the same class fitted "
          "once for the layer (same anchors, out of sample): median rel_err(<class>.layer) − rel_err(class), "
          "against 0", {"zero": Test(_median_difference("layer.rel_err", "rel_err"), None,
                                     ("rel_err", "layer.rel_err"))}, 0.05,
          "(assumed: the fits are local)", classes="local",
          plain="A map fitted per neighbourhood explains the update better than the same map fitted once per layer.",
          label="local fit beats layer fit"),
    # Its two parts are its "nulls" (each against a permuted capacity order): supported only when both are.
    Claim("expressivity_tradeoff", "more expressive classes shrink the residual (median rel_err falls with "
          "capacity) but weaken its correlation with KL (Spearman(rel_err, kl) falls with capacity): "
          "−Spearman(capacity, value) over the local classes per layer, against a permuted capacity order",
          {}, 0.5, "more expressive classes: smaller residual, weaker link to KL", classes="across",
          plain="More expressive fit classes leave a smaller residual, but one that predicts the output change "
          "less well.", label="expressivity trade-off"),
)
CLAIM_NAMES = tuple(c.name for c in CLAIMS)


# ------------------------------------------------------------------------------------- the tests
def subject_of(model: str) -> str:
    """What the claims are stated for: `<arch>@<checkpoint>` for a trained checkpoint (its seeds are
    combined), the model id for an external model."""
    match = re.match(r"^(.*)@(init|final)$", model)
    return f"{parse_run_id(match[1]).arch}@{match[2]}" if match else model


@dataclass(frozen=True)
class Stratum:
    """One (model, layer, class): its per-anchor columns."""

    model: str
    subject: str  # `<arch>@<checkpoint>` for a trained model, the model id otherwise
    layer: int
    fn: str
    columns: Columns


@dataclass(frozen=True)
class Replicates:
    """A stratum's effect for one (claim, null): the point values and `n_boot` bootstrap replicates."""

    statistic: float
    null: float
    effect: float
    boot: np.ndarray  # (n_boot,) effect replicates
    n: int


def stratum_effect(stratum: Stratum, test: Test, n_boot: int, seed: int) -> Replicates | None:
    """The effect of one test in one stratum over its anchors where every column is defined (and, for a
    log ratio, positive), or None when a column is missing or fewer than `MIN_ANCHORS` anchors remain."""
    if any(c not in stratum.columns for c in test.columns):
        return None
    values = [stratum.columns[c] for c in test.columns]
    complete = np.all([np.isfinite(v) for v in values], axis=0)
    n = int(complete.sum())
    if n < MIN_ANCHORS:
        return None
    cols = {c: v[complete] for c, v in zip(test.columns, values, strict=True)}
    everything = np.arange(n)[None]
    draws = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    null = test.null or (lambda c, idx: np.zeros(idx.shape[0]))
    with np.errstate(divide="ignore", invalid="ignore"):
        point_real, point_null = float(test.statistic(cols, everything)[0]), float(null(cols, everything)[0])
        boot = test.statistic(cols, draws) - null(cols, draws)
    return Replicates(point_real, point_null, point_real - point_null, boot, n)


def verdict(effect: float, high: float, margin: float, p_above: float, p_below: float, alpha: float) -> str:
    """The reading of an effect (module docstring): `p_above`, `p_below` the adjusted one-sided p-values of
    the effect being > 0 and < 0, `high` its interval's upper end, `alpha` the one-sided level."""
    if not all(math.isfinite(v) for v in (effect, high, p_above, p_below)):
        return INCONCLUSIVE
    if p_below <= alpha:
        return CONTRADICTED
    if p_above <= alpha:
        return SUPPORTED if effect >= margin else NOT_SUPPORTED if high < margin else INCONCLUSIVE
    return INCONCLUSIVE


def combined_verdict(verdicts: Sequence[str]) -> str:
    """Over a claim's nulls: supported against every null; contradicted, else not supported, against any;
    else inconclusive."""
    if verdicts and all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    return next((v for v in (CONTRADICTED, NOT_SUPPORTED) if v in verdicts), INCONCLUSIVE)


CLAIM_TESTS_SCHEMA = pa.schema(
    [("subject", pa.string()), ("fn", pa.string()), ("claim", pa.string()), ("null", pa.string()),
     ("scope", pa.string()), ("layer", pa.int32()), ("n_models", pa.int64()), ("n_layers", pa.int64()),
     ("n", pa.int64()), ("statistic", pa.float64()), ("null_statistic", pa.float64()), ("effect", pa.float64()),
     ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("p_above", pa.float64()), ("p_below", pa.float64()),
     ("margin", pa.float64()), ("verdict", pa.string())]
)  # fmt: skip


Capacities = Mapping[str, Mapping[str, int]]  # model -> local tokenwise class -> its free parameters
Effects = dict[tuple[str, str], dict[str, dict[int, Replicates]]]  # (subject, fn) -> model -> layer -> effect


def claim_tests(strata: Sequence[Stratum], capacities: Capacities, n_boot: int, ci: float, seed: int) -> pa.Table:
    """Every claim against each of its nulls: per (subject, class, layer) over the subject's models
    (scope `layer`), and over its layers and models (scope `stratified`); the p-values Holm-adjusted over
    the rows of one (subject, claim, scope, layer) and the verdicts read from them. The expressivity
    trade-off is tested on the `ACROSS` strata, with the classes' `capacities` (a model without one: not
    tested)."""
    rows = []
    models = sorted({s.model for s in strata})
    for claim in CLAIMS:
        for null, test in claim.tests.items():
            effects: Effects = {}
            for s in strata:
                if not _applies(claim, s.fn):
                    continue
                # One draw per model: a model's layers share their anchors, so where a layer keeps them all
                # its resample is the same anchors' (they are not independent across layers).
                rep = stratum_effect(s, test, n_boot, seed + models.index(s.model))
                if rep is not None:
                    effects.setdefault((s.subject, s.fn), {}).setdefault(s.model, {})[s.layer] = rep
            rows += _rows(effects, claim, null, n_boot, ci, seed)
    rows += _tradeoff_rows(class_values(strata, capacities, n_boot, seed), n_boot, ci, seed)
    return pa.Table.from_pylist(_read(rows, (1 - ci) / 2), schema=CLAIM_TESTS_SCHEMA)


def _rows(effects: Effects, claim: Claim, null: str, n_boot: int, ci: float, seed: int) -> list[dict[str, object]]:
    """Per (subject, class): a row per layer over its models, and one over its layers and models."""
    rows = []
    for (subject, fn), by_model in sorted(effects.items()):
        cell = (subject, fn, claim, null)
        for layer in sorted({layer for reps in by_model.values() for layer in reps}):
            at_layer = [reps[layer] for reps in by_model.values() if layer in reps]
            rows.append(_row(*cell, "layer", layer, at_layer, 1, n_boot, ci, seed))
        over_layers = [_mean_over_layers(list(reps.values())) for reps in by_model.values()]
        n_layers = len({layer for reps in by_model.values() for layer in reps})
        rows.append(_row(*cell, "stratified", None, over_layers, n_layers, n_boot, ci, seed))
    return rows


# ------------------------------------------------------------------- the expressivity trade-off
MIN_CLASSES = 3  # a rank correlation over fewer classes orders nothing a permutation could not
TRADEOFF = next(c for c in CLAIMS if c.classes == "across")
# A class's value on drawn anchors (index rows (B, n)) -> (B,): what the trade-off ranks by capacity.
PARTS: dict[str, Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]] = {
    "rel_err": lambda rel_err, kl, idx: np.median(rel_err[idx], axis=-1),
    "spearman": lambda rel_err, kl, idx: spearman_of_draws(rel_err, kl, idx),
}


@dataclass(frozen=True)
class ClassValues:
    """One (model, layer) across its local tokenwise classes, on the anchors all of them keep: per part, each
    class's value on those anchors and its `n_boot` replicates (the same anchor draws for every class)."""

    model: str
    subject: str
    layer: int
    capacity: dict[str, int]  # class -> free parameters
    point: dict[str, dict[str, float]]  # part -> class -> value
    boot: dict[str, dict[str, np.ndarray]]  # part -> class -> (n_boot,) replicates
    n: int


def class_values(strata: Sequence[Stratum], capacities: Capacities, n_boot: int, seed: int) -> list[ClassValues]:
    """The `ACROSS` strata's per-class values (columns `<class>.rel_err`, `<class>.kl`) of the models with
    capacities; none where fewer than `MIN_CLASSES` classes or `MIN_ANCHORS` common anchors remain."""
    models = sorted({s.model for s in strata})
    out = []
    for s in strata:
        capacity = {fn: n for fn, n in capacities.get(s.model, {}).items() if f"{fn}.rel_err" in s.columns}
        if s.fn != ACROSS or len(capacity) < MIN_CLASSES:
            continue
        values = {fn: (s.columns[f"{fn}.rel_err"], s.columns[f"{fn}.kl"]) for fn in capacity}
        complete = np.all([np.isfinite(v) for pair in values.values() for v in pair], axis=0)
        n = int(complete.sum())
        if n < MIN_ANCHORS:
            continue
        draws = np.random.default_rng(seed + models.index(s.model)).integers(0, n, size=(n_boot, n))
        point: dict[str, dict[str, float]] = {part: {} for part in PARTS}
        boot: dict[str, dict[str, np.ndarray]] = {part: {} for part in PARTS}
        for fn, (rel_err, kl) in values.items():
            for part, value in PARTS.items():
                point[part][fn] = float(value(rel_err[complete], kl[complete], np.arange(n)[None])[0])
                boot[part][fn] = value(rel_err[complete], kl[complete], draws)
        out.append(ClassValues(s.model, s.subject, s.layer, capacity, point, boot, n))
    return out


def falls_with_capacity(capacity: Mapping[str, int], values: Mapping[str, np.ndarray | float]) -> np.ndarray:
    """−Spearman(capacity, value) over the classes, per replicate: +1 when the value falls strictly with
    capacity, −1 when it rises."""
    fns = sorted(capacity)
    stacked = np.stack([np.asarray(values[fn], dtype=float) for fn in fns], axis=-1)
    return -spearman_rows(np.broadcast_to(np.array([capacity[fn] for fn in fns], float), stacked.shape), stacked)


def _tradeoff_rows(cells: list[ClassValues], n_boot: int, ci: float, seed: int) -> list[dict[str, object]]:
    """The trade-off's rows (fn `ACROSS`, null = the part), each p the larger of the bootstrap's and the
    permuted capacity order's."""
    rows = []
    for part in PARTS:
        effects: Effects = {}
        for c in cells:
            trend = float(falls_with_capacity(c.capacity, c.point[part])[()])
            rep = Replicates(trend, 0.0, trend, falls_with_capacity(c.capacity, c.boot[part]), c.n)
            effects.setdefault((c.subject, ACROSS), {}).setdefault(c.model, {})[c.layer] = rep
        for row in _rows(effects, TRADEOFF, part, n_boot, ci, seed):
            at = [c for c in cells if c.subject == row["subject"] and row["layer"] in (None, c.layer)]
            above, below = permutation_p(at, part)
            row["p_above"], row["p_below"] = max(row["p_above"], above), max(row["p_below"], below)  # type: ignore[call-overload]
            rows.append(row)
    return rows


def permutation_p(cells: Sequence[ClassValues], part: str) -> tuple[float, float]:
    """One-sided p-values of the trade-off's effect (the mean over models of the mean over their layers)
    against every permutation of the capacities among the classes (the same one in every cell; a cell
    without every class of the others takes no part): the share of permutations whose effect is at least
    (at most) the observed one, ties counted with the null."""
    fns = sorted({fn for c in cells for fn in c.capacity})
    orders = np.array(list(itertools.permutations(range(len(fns)))))  # (P, C), the identity first
    by_model: dict[str, list[np.ndarray]] = {}
    for c in cells:
        if sorted(c.capacity) == fns:
            capacity = np.array([c.capacity[fn] for fn in fns], float)[orders]
            values = np.broadcast_to(np.array([c.point[part][fn] for fn in fns]), capacity.shape)
            by_model.setdefault(c.model, []).append(-spearman_rows(capacity, values))
    if not by_model:
        return 1.0, 1.0
    effects = np.mean([np.mean(layers, axis=0) for layers in by_model.values()], axis=0)  # (P,)
    observed = effects[0]
    if not math.isfinite(observed):
        return 1.0, 1.0
    return float(np.mean(effects >= observed - 1e-12)), float(np.mean(effects <= observed + 1e-12))


def _applies(claim: Claim, fn: str) -> bool:
    if fn.endswith(LAYER_FIT) or fn == ACROSS:  # a baseline of the locality claim; the trade-off's strata
        return False
    if fn not in FIT_CLASSES:
        return True
    fit_class = FIT_CLASSES[fn]
    return fit_class.local if claim.classes == "local" else fit_class.tokenwise


def _mean_over_layers(reps: list[Replicates]) -> Replicates:
    """One model's effect over its layers: the mean of the layers' effects and of their replicates."""
    mean = lambda values: float(np.mean(values))  # noqa: E731
    return Replicates(mean([r.statistic for r in reps]), mean([r.null for r in reps]),
                      mean([r.effect for r in reps]), np.mean([r.boot for r in reps], axis=0), sum(r.n for r in reps))


def seed_level_replicates(per_model: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """The two-stage bootstrap of the mean over models (seeds): each replicate draws the models with
    replacement, then for each drawn model one of its own anchor-level replicates (a fresh one per draw,
    so a model drawn twice contributes two resamples of its anchors). One model: its replicates."""
    boot = np.asarray(per_model)  # (models, n_boot)
    n_models, n_boot = boot.shape
    if n_models == 1:
        return boot[0]
    drawn = rng.integers(0, n_models, size=(n_boot, n_models))
    which = np.stack([rng.permutation(n_boot) for _ in range(n_models)], axis=1)  # (n_boot, draws)
    return boot[drawn, which].mean(axis=1)


def percentile_interval(boot: np.ndarray, ci: float) -> tuple[float, float]:
    """The central `ci` percentile interval of the finite replicates (NaN where none is)."""
    finite = boot[np.isfinite(boot)]
    if not finite.size:
        return math.nan, math.nan
    low, high = np.percentile(finite, [50 * (1 - ci), 50 * (1 + ci)])
    return float(low), float(high)


def _row(subject: str, fn: str, claim: Claim, null: str, scope: str, layer: int | None, reps: list[Replicates],
         n_layers: int, n_boot: int, ci: float, seed: int) -> dict[str, object]:  # fmt: skip
    boot = seed_level_replicates([r.boot for r in reps], np.random.default_rng([seed, n_boot, len(reps)]))
    finite = boot[np.isfinite(boot)]
    low, high = percentile_interval(boot, ci)
    one_sided = lambda count: (1 + count) / (1 + finite.size) if finite.size else np.nan  # noqa: E731
    mean = lambda values: float(np.mean(values))  # noqa: E731
    return {
        "subject": subject, "fn": fn, "claim": claim.name, "null": null, "scope": scope, "layer": layer,
        "n_models": len(reps), "n_layers": n_layers, "n": sum(r.n for r in reps),
        "statistic": mean([r.statistic for r in reps]), "null_statistic": mean([r.null for r in reps]),
        "effect": mean([r.effect for r in reps]), "ci_low": float(low), "ci_high": float(high),
        "p_above": one_sided(int((finite <= 0).sum())), "p_below": one_sided(int((finite >= 0).sum())),
        "margin": claim.margin,
    }  # fmt: skip


def _read(rows: list[dict[str, object]], alpha: float) -> list[dict[str, object]]:
    """Holm-adjust each direction's p-values over the rows of one summary cell (subject, claim, scope,
    layer: its classes and nulls, baselines left out), then read each row's verdict at one-sided `alpha`."""
    cells: dict[tuple[object, ...], list[dict[str, object]]] = {}
    for r in rows:
        if in_summary(str(r["fn"])):
            cells.setdefault((r["subject"], r["claim"], r["scope"], r["layer"]), []).append(r)
    for members in cells.values():
        for column in ("p_above", "p_below"):
            for r, adjusted in zip(members, holm([float(m[column]) for m in members]), strict=True):  # type: ignore[arg-type]
                r[column] = adjusted
    for r in rows:
        r["verdict"] = verdict(*(float(r[c]) for c in ("effect", "ci_high", "margin", "p_above", "p_below")),  # type: ignore[arg-type]
                               alpha)  # fmt: skip
    return rows


def in_summary(fn: str) -> bool:
    """Whether a class counts in a claim's summary: a local class (not a baseline)."""
    if fn.endswith(LAYER_FIT):
        return False
    return fn not in FIT_CLASSES or FIT_CLASSES[fn].local


# ----------------------------------------------------------------------------------- the headline
VERDICT_SCORE = {SUPPORTED: 1.0, INCONCLUSIVE: 0.0, NOT_SUPPORTED: -0.5, CONTRADICTED: -1.0}
_STRENGTH = {CONTRADICTED: 0, NOT_SUPPORTED: 1, INCONCLUSIVE: 2, SUPPORTED: 3}
READINGS = (SUPPORTED, NOT_SUPPORTED, CONTRADICTED, INCONCLUSIVE)


@dataclass(frozen=True)
class ClaimSummary:
    """One claim for one subject (`<arch>@<checkpoint>` or a model id), over the classes it applies to:
    each class's verdict (over the claim's nulls, `combined_verdict`) and the test that decides the weakest
    of them, the one the headline shows (a `claim_tests` row at scope `stratified`)."""

    subject: str
    claim: str
    verdicts: dict[str, str]  # class -> combined verdict
    weakest: dict[str, object]
    layers: dict[str, int]  # class -> the layers its verdict rests on (the fewest over its nulls)

    @property
    def score(self) -> float:
        """+1 supported, 0 inconclusive, −½ not supported, −1 contradicted, averaged over the classes: one
        number that `dvc metrics diff` can compare across experiments."""
        return float(np.mean([VERDICT_SCORE[v] for v in self.verdicts.values()]))

    @property
    def verdict(self) -> str:
        """The verdict where every class agrees, else `mixed` with the count of each."""
        distinct = set(self.verdicts.values())
        if len(distinct) == 1:
            return distinct.pop()
        counts = {v: list(self.verdicts.values()).count(v) for v in READINGS}
        return "mixed: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)


def summarise(tests: Sequence[dict[str, object]]) -> list[ClaimSummary]:
    """Per (subject, claim), in `CLAIMS` order, from the stratified rows of the `claim_tests` table."""
    groups: dict[tuple[str, str], list[dict[str, object]]] = {}
    for t in tests:
        if t["scope"] == "stratified" and in_summary(str(t["fn"])):
            groups.setdefault((str(t["subject"]), str(t["claim"])), []).append(t)
    out = []
    for (subject, claim), rows in sorted(groups.items(), key=lambda g: (g[0][0], CLAIM_NAMES.index(g[0][1]))):
        by_class: dict[str, list[str]] = {}
        layers: dict[str, int] = {}
        for r in rows:
            by_class.setdefault(str(r["fn"]), []).append(str(r["verdict"]))
            layers[str(r["fn"])] = min(layers.get(str(r["fn"]), int(r["n_layers"])), int(r["n_layers"]))  # type: ignore[call-overload]
        # The deciding test: the weakest verdict, then the lowest interval (a missing one counts as lowest).
        weakest = min(rows, key=lambda r: (_STRENGTH[str(r["verdict"])], _finite_or_low(r["ci_low"])))
        verdicts = {fn: combined_verdict(vs) for fn, vs in sorted(by_class.items())}
        out.append(ClaimSummary(subject, claim, verdicts, weakest, dict(sorted(layers.items()))))
    return out


def _finite_or_low(x: object) -> float:
    return float(x) if isinstance(x, float) and math.isfinite(x) else -math.inf
