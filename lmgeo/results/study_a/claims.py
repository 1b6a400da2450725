"""Study A's claims as tests against nulls (SPEC §4.4, §4.5).

Each claim is a statistic of a (model, layer, class) stratum's anchors and a *null* that gives zero under the
null: the same statistic on a null sample (the fits on `shuffled` pairs, on the `gaussian` pool), on one null
patch at a time (each random direction of `kl_directions`, whose statistics are averaged, or `kl_other`), a
constant (0.5 for the share of null patches the real one outweighs), or zero where the statistic is itself an
effect. Like is compared with like: `E_j ρ(rel_err, kl_j)`, never `ρ(rel_err, mean_j kl_j)` (averaging the
directions removes their noise, and the mean of a right-skewed KL sits above its median). The effect is
statistic − null, signed so that positive is the claim's direction.

Intervals, with no random stream: a subject (`<arch>@<checkpoint>`) has one model per trained seed; a model's
effect over layers is the mean of its layers' (never rows of different layers ranked together), the subject's
the mean over its seeds, with the Student-t interval over the seeds' effects (their spread holds the anchors'
noise and the seeds'). A subject with one model (an external model, `lmgeo analyse`) has no seed level: its
replicates are `ANCHOR_GROUPS` disjoint blocks of its anchors (in stored order: sequences stay together), its
effect the whole sample's, its t-interval the blocks' spread over √blocks ("random groups"). That interval
says how the verdict could change with other tokens of the same model, nothing about other seeds. Each row
carries one-sided t-test p-values, Holm-adjusted over the rows one summary cell combines (a subject's voting
classes × nulls for the claim, at one scope and layer).

Readings of an effect with the claim's margin m (the smallest effect worth the name), at one-sided α:
**contradicted** when it is below 0 beyond chance; **supported** when it is above m beyond chance (the
adjusted lower confidence bound above the margin); **not supported** when it is below m beyond chance (any
effect too small to count); **inconclusive** otherwise. A stratum with fewer than `MIN_ANCHORS` complete anchors
is left out, and so is every stratum of a layer whose pool is not well posed (`well_posed`, the one rule).

The paper's classes vote (`votes`): the local classes but the diagnostic ones (`FitClass.diagnostic`: the
unscaled `orthogonal`, tested and reported beside them); `global_linear` and the layer-wide fits
(`<class>.layer`) are baselines. The paper's claims (`Claim.source == "paper"`) make the headline; the project's
own checks are reported apart.

The expressivity trade-off is the paper's statement about MLPs against linear maps: per (model, layer), each
local class that is not linear (`mlp`) against each that is, on the anchors both keep (`fn` = `"<mlp> vs
<linear>"`), two parts, each an effect against 0: `rel_err` = median over anchors of rel_err(linear) −
rel_err(mlp) (paired per anchor; positive: the MLP's residual is smaller) and `spearman` = Spearman(rel_err,
kl) of the linear class − the MLP's (positive: the MLP's residual predicts the output change less well).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from lmgeo.core.contracts import parse_run_id
from lmgeo.results.stats import average_ranks, holm, pearson_rows
from lmgeo.study_a.classes import FIT_CLASSES

MIN_ANCHORS = 10
ANCHOR_GROUPS = 5  # a one-model subject's replicates: disjoint blocks of its anchors (as many as the default seeds)
MIN_GROUP_ANCHORS = 3  # a block with fewer complete anchors has no effect (a rank correlation needs 3)
# A pool with fewer distinct inputs than this many per neighbour repeats its tokens: statements about the layer
# would rest on copies (the neighbourhoods of a repeated token are the same few vectors).
DISTINCT_PER_NEIGHBOUR = 10
SUPPORTED, NOT_SUPPORTED, CONTRADICTED, INCONCLUSIVE = "supported", "not supported", "contradicted", "inconclusive"
LAYER_FIT = ".layer"  # `<class>.layer`: the local class fitted once for the whole layer (the locality baseline)
VERSUS = " vs "  # the `fn` of a trade-off stratum: `<nonlinear class> vs <linear class>`
SEED, ANCHOR_GROUP = "seed", "anchor group"  # what a row's replicates are (`unit`)

Columns = dict[str, np.ndarray]  # one stratum's per-anchor values: "<column>" real, "<sample>.<column>" null
Statistic = Callable[[Columns, np.ndarray], float]  # (columns, anchor indices) -> the statistic on those anchors


def well_posed(n_distinct: int, k: int) -> bool:
    """Whether a layer's pool supports statements about the layer: at least `DISTINCT_PER_NEIGHBOUR` distinct
    inputs per neighbour of a neighbourhood. The one rule: a layer that fails it is left out of every claim."""
    return n_distinct >= DISTINCT_PER_NEIGHBOUR * k


def _median(column: str) -> Statistic:
    return lambda c, idx: float(np.median(c[column][idx]))


def _median_difference(a: str, b: str) -> Statistic:
    return lambda c, idx: float(np.median(c[a][idx] - c[b][idx]))


def _median_acute(column: str) -> Statistic:
    """The median acute angle between the lines of two vectors, 90° − |90° − angle|: near 90° exactly when
    they are near orthogonal, whichever way each points."""
    return lambda c, idx: float(np.median(90.0 - np.abs(90.0 - c[column][idx])))


# The functional claims compare the real patch's KL (`kl`) with a null patch's: `kl_directions` (one column per
# random direction: each is a null draw, and a statistic of the null is the mean of its draws' statistics) or
# `kl_other` (one draw).
RANDOM, OTHER = "kl_directions", "kl_other"


def _draws(c: Columns, idx: np.ndarray, source: str) -> np.ndarray:
    """The null KLs of `source` at anchors `idx`, one row per draw: (draws, anchors)."""
    values = c[source][idx]
    return values.T if values.ndim == 2 else values[None]


def _rho(x: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Spearman's ρ of `x` (n,) with each row of `draws` (J, n) (`x` ranked once)."""
    return pearson_rows(average_ranks(x)[None], average_ranks(draws))


def _spearman_with(kl: str) -> Statistic:
    """Spearman(rel_err, kl), the mean over the draws of `kl` (the real `kl`: one draw)."""
    return lambda c, idx: float(np.mean(_rho(c["rel_err"][idx], _draws(c, idx, kl))))


def _partial_spearman_with(kl: str) -> Statistic:
    """Partial Spearman(rel_err, kl | rel_err_state): the partial correlation of the ranks, the mean over the
    draws of `kl`."""

    def stat(c: Columns, idx: np.ndarray) -> float:
        x, z, draws = c["rel_err"][idx], c["rel_err_state"][idx], _draws(c, idx, kl)
        xy, yz, xz = _rho(x, draws), _rho(z, draws), float(_rho(x, z[None])[0])
        with np.errstate(invalid="ignore", divide="ignore"):
            return float(np.mean((xy - xz * yz) / np.sqrt((1 - xz**2) * (1 - yz**2))))

    return stat


def _share_outweighed(null: str) -> Statistic:
    """The share of null patches whose KL is below the real patch's (ties count a half), over the draws and
    anchors: 0.5 when the real residual is one more draw of the null."""

    def stat(c: Columns, idx: np.ndarray) -> float:
        real, draws = c["kl"][idx], _draws(c, idx, null)
        return float(np.mean((draws < real) + 0.5 * (draws == real)))

    return stat


def _spearman_difference(c: Columns, idx: np.ndarray) -> float:
    """Spearman(rel_err, kl) of a trade-off pair's linear class minus its non-linear class's (`nonlinear.*`),
    on the same anchors."""
    linear = _rho(c["rel_err"][idx], c["kl"][idx][None])
    return float((linear - _rho(c["nonlinear.rel_err"][idx], c["nonlinear.kl"][idx][None]))[0])


@dataclass(frozen=True)
class Test:
    """One null of a claim: the statistic on the real values, the same on the null (a float: a constant, 0
    where the statistic is itself an effect), every column the two read, and its margin where it is not the
    claim's (the trade-off's two parts)."""

    statistic: Statistic
    null: Statistic | float
    columns: tuple[str, ...]
    margin: float | None = None


@dataclass(frozen=True)
class Claim:
    name: str
    text: str  # the claim, as tested here
    tests: dict[str, Test]  # null name -> test
    margin: float  # the smallest effect that counts
    seed_value: str  # what the paper reports, for the reader
    # "tokenwise" (every class but identity), "local", or "versus" (one stratum per MLP-vs-linear pair)
    classes: str = "tokenwise"
    # For a newcomer (the report's summary): the claim as one plain sentence, and as a row label of a few words
    # (the heat map's rows, the detail table's). Every claim has both (tests/test_report.py).
    plain: str = ""
    label: str = ""
    # "paper": one of the paper's claims (the headline counts them); "project": a check this project adds.
    source: str = "paper"


def _geometric(
    name: str,
    text: str,
    columns: tuple[str, ...],
    margin: float,
    seed_value: str,
    plain: str,
    label: str,
    of_one: Callable[[str], Statistic] = _median,
) -> Claim:
    """A median (`of_one` column, or of the difference of two) against the same on each null sample."""

    def stat(prefix: str) -> Statistic:
        names = [prefix + c for c in columns]
        return of_one(names[0]) if len(names) == 1 else _median_difference(*names)

    tests = {
        sample: Test(stat(""), stat(f"{sample}."), columns + tuple(f"{sample}.{c}" for c in columns))
        for sample in ("shuffled", "gaussian")
    }
    return Claim(name, text, tests, margin, seed_value, plain=plain, label=label)


NULL_PATCHES = {"random": RANDOM, "other": OTHER}  # a functional claim's null name -> the KLs of its patches

CLAIMS: tuple[Claim, ...] = (
    _geometric(
        "cos_full_tok_near_1",
        "the full update is aligned with its tokenwise part (median cos_full_tok)",
        ("cos_full_tok",),
        0.05,
        "near 1",
        "A layer's update points where its tokenwise part points, more than on shuffled or random inputs.",
        "update along tokenwise part",
    ),
    _geometric(
        "angle_res_tok_near_90",
        "the residual is closer to orthogonal to the tokenwise part than the "
        "null's (median acute angle 90° − |90° − angle_res_tok|)",
        ("angle_res_tok",),
        5.0,
        "often > 60°",
        "What the tokenwise part misses (the residual) is closer to orthogonal to it than by chance.",
        "residual orthogonal to it",
        _median_acute,
    ),
    _geometric(
        "proj_res_below_full",
        "the residual projects less than the full update on the dominant local "
        "tokenwise subspace (median proj_full − proj_res)",
        ("proj_full", "proj_res"),
        0.05,
        "significantly lower",
        "The residual lies less in the neighbourhood's main tokenwise directions than the update does.",
        "residual off local subspace",
    ),
    _geometric(
        "proj_res_global_below_full",
        "the same on the layer's global tokenwise subspace (median proj_full_global − proj_res_global)",
        ("proj_full_global", "proj_res_global"),
        0.05,
        "significantly lower",
        "The same for the layer's main tokenwise directions.",
        "residual off layer subspace",
    ),
    Claim(
        "spearman_rel_err_kl",
        "the residual's size predicts the output change: Spearman(rel_err, kl) against "
        "the same with the KL of one null patch of the same norm (averaged over the random directions)",
        {
            null: Test(_spearman_with("kl"), _spearman_with(kl), ("rel_err", "kl", kl))
            for null, kl in NULL_PATCHES.items()
        },
        0.1,
        "> 0.7, up to 0.95",
        plain="The bigger the residual, the more removing it changes the output, more so than for a patch of the "
        "same size in another direction.",
        label="residual size → output change",
    ),
    Claim(
        "residual_outweighs_null",
        "removing the real residual moves the output more than removing a null "
        "residual of the same norm: the share of null patches whose KL is below the real one's, against 0.5",
        {null: Test(_share_outweighed(kl), 0.5, ("kl", kl)) for null, kl in NULL_PATCHES.items()},
        0.1,
        "the residual is functionally decisive",
        plain="Removing the residual changes the output more than removing a patch of the same size in another "
        "direction does, for at least 60% of such patches.",
        label="residual moves the output",
    ),
    # Its two parts are its "nulls", each against 0, one row per MLP-vs-linear pair: supported only when both are.
    Claim(
        "expressivity_tradeoff",
        "small MLPs instead of linear maps shrink the residual (median over anchors of "
        "rel_err(linear) − rel_err(mlp)) but weaken its correlation with KL (Spearman(rel_err, kl) of the linear "
        "map − the MLP's), on the anchors both keep",
        {
            "rel_err": Test(
                _median_difference("rel_err", "nonlinear.rel_err"), 0.0, ("rel_err", "nonlinear.rel_err"), 0.05
            ),
            "spearman": Test(_spearman_difference, 0.0, ("rel_err", "kl", "nonlinear.rel_err", "nonlinear.kl"), 0.1),
        },
        0.05,
        "MLPs instead of linear maps: smaller residual, weaker link to KL",
        classes="versus",
        plain="A small MLP leaves a smaller residual than a linear map, but one that predicts the output change "
        "less well.",
        label="expressivity trade-off",
    ),
    Claim(
        "partial_spearman_rel_err_kl",
        "the residual's size predicts the output change once its size relative "
        "to the state (rel_err_state) is partialled out: partial Spearman(rel_err, kl | rel_err_state) against "
        "the same with one null patch's KL",
        {
            null: Test(_partial_spearman_with("kl"), _partial_spearman_with(kl), ("rel_err", "kl", "rel_err_state", kl))
            for null, kl in NULL_PATCHES.items()
        },
        0.1,
        "(not reported)",
        plain="The same, once the residual's size relative to the hidden state is accounted for.",
        label="residual size → KL, partial",
        source="project",
    ),
    Claim(
        "local_beats_layer",
        "a local class explains more fitted per neighbourhood than the same class fitted "
        "once for the layer (same anchors, out of sample): median rel_err(<class>.layer) − rel_err(class), "
        "against 0",
        {"zero": Test(_median_difference("layer.rel_err", "rel_err"), 0.0, ("rel_err", "layer.rel_err"))},
        0.05,
        "(assumed: the fits are local)",
        classes="local",
        plain="A map fitted per neighbourhood explains the update better than the same map fitted once per layer.",
        label="local fit beats layer fit",
        source="project",
    ),
)
CLAIM_NAMES = tuple(c.name for c in CLAIMS)
PAPER_CLAIMS = tuple(c.name for c in CLAIMS if c.source == "paper")


# ------------------------------------------------------------------------------------- the tests
def subject_of(model: str) -> str:
    """What the claims are stated for: `<arch>@<checkpoint>` for a trained checkpoint (its seeds are
    combined), the model id for an external model."""
    match = re.match(r"^(.*)@(init|final)$", model)
    return f"{parse_run_id(match[1]).arch}@{match[2]}" if match else model


@dataclass(frozen=True)
class Stratum:
    """One (model, layer, class): its per-anchor columns, in the anchors' stored order."""

    model: str
    subject: str  # `<arch>@<checkpoint>` for a trained model, the model id otherwise
    layer: int
    fn: str
    columns: Columns


@dataclass(frozen=True)
class Effect:
    """A stratum's effect for one (claim, null) on its complete anchors, and the same on each of
    `ANCHOR_GROUPS` disjoint blocks of its anchors (NaN for a block with too few)."""

    statistic: float
    null: float
    effect: float
    groups: np.ndarray  # (ANCHOR_GROUPS,)
    n: int


def anchor_groups(n: int) -> list[np.ndarray]:
    """The anchors' blocks, `ANCHOR_GROUPS` consecutive slices of a stratum's stored order (sequences, then
    positions): a model's layers share their anchors, so a block holds the same anchors at every layer."""
    return np.array_split(np.arange(n), ANCHOR_GROUPS)


def stratum_effect(stratum: Stratum, test: Test, groups: bool = True) -> Effect | None:
    """The effect of one test in one stratum over its anchors where every column is defined, or None when a
    column is missing or fewer than `MIN_ANCHORS` anchors remain; with `groups`, also on each block of its
    anchors (else those are NaN: a subject with several models does not use them)."""
    if any(c not in stratum.columns for c in test.columns):
        return None
    values = [stratum.columns[c] for c in test.columns]
    # a 2-D column (one draw per direction) is complete where it has draws, all finite
    complete = np.all(
        [np.isfinite(v).all(axis=1) & (v.shape[1] > 0) if v.ndim == 2 else np.isfinite(v) for v in values], axis=0
    )
    n = int(complete.sum())
    if n < MIN_ANCHORS:
        return None
    cols = {c: v[complete] for c, v in zip(test.columns, values, strict=True)}
    kept_in = np.cumsum(complete) - 1  # an anchor's index among the complete ones

    def effect(idx: np.ndarray) -> tuple[float, float]:
        with np.errstate(divide="ignore", invalid="ignore"):
            null = test.null if isinstance(test.null, float) else test.null(cols, idx)
            return test.statistic(cols, idx), null

    statistic, null = effect(np.arange(n))
    blocks = np.full(ANCHOR_GROUPS, math.nan)
    for i, block in enumerate(anchor_groups(len(complete)) if groups else []):
        idx = kept_in[block[complete[block]]]
        blocks[i] = np.subtract(*effect(idx)) if len(idx) >= MIN_GROUP_ANCHORS else math.nan
    return Effect(statistic, null, statistic - null, blocks, n)


def one_model_subjects(strata: Sequence[Stratum]) -> set[str]:
    """The subjects with a single model (an external model, `lmgeo analyse`): their replicates are anchor blocks."""
    models: dict[str, set[str]] = {}
    for s in strata:
        models.setdefault(s.subject, set()).add(s.model)
    return {subject for subject, found in models.items() if len(found) == 1}


def verdict(p_below: float, p_above_margin: float, p_below_margin: float, alpha: float) -> str:
    """The reading of an effect (module docstring) from its adjusted one-sided p-values: of being < 0, > the
    margin and < the margin; `alpha` the one-sided level."""
    if not all(math.isfinite(v) for v in (p_below, p_above_margin, p_below_margin)):
        return INCONCLUSIVE
    if p_below <= alpha:
        return CONTRADICTED
    if p_above_margin <= alpha:
        return SUPPORTED
    if p_below_margin <= alpha:
        return NOT_SUPPORTED
    return INCONCLUSIVE


def combined_verdict(verdicts: Sequence[str]) -> str:
    """Over a claim's nulls: supported against every null; contradicted, else not supported, against any;
    else inconclusive."""
    if verdicts and all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    return next((v for v in (CONTRADICTED, NOT_SUPPORTED) if v in verdicts), INCONCLUSIVE)


P_COLUMNS = ("p_above", "p_below", "p_above_margin", "p_below_margin")
CLAIM_TESTS_SCHEMA = pa.schema(
    [
        ("subject", pa.string()),
        ("fn", pa.string()),
        ("claim", pa.string()),
        ("null", pa.string()),
        ("scope", pa.string()),
        ("layer", pa.int32()),
        ("n_models", pa.int64()),
        ("n_layers", pa.int64()),
        ("n", pa.int64()),
        ("unit", pa.string()),
        ("n_units", pa.int64()),
        ("statistic", pa.float64()),
        ("null_statistic", pa.float64()),
        ("effect", pa.float64()),
        ("ci_low", pa.float64()),
        ("ci_high", pa.float64()),
    ]
    + [(p, pa.float64()) for p in P_COLUMNS]
    + [("margin", pa.float64()), ("verdict", pa.string())]
)


Effects = dict[tuple[str, str], dict[str, dict[int, Effect]]]  # (subject, fn) -> model -> layer -> effect


def claim_tests(strata: Sequence[Stratum], ci: float) -> pa.Table:
    """Every claim against each of its nulls: per (subject, class, layer) over the subject's models (scope
    `layer`), and over its layers and models (scope `stratified`); the p-values Holm-adjusted over the rows of
    one (subject, claim, scope, layer) and the verdicts read from them. Nothing here is drawn at random."""
    rows, alone = [], one_model_subjects(strata)
    for claim in CLAIMS:
        for null, test in claim.tests.items():
            effects: Effects = {}
            for s in strata:
                if _applies(claim, s.fn) and (effect := stratum_effect(s, test, s.subject in alone)) is not None:
                    effects.setdefault((s.subject, s.fn), {}).setdefault(s.model, {})[s.layer] = effect
            rows += _rows(effects, claim, null, ci)
    return pa.Table.from_pylist(_read(rows, (1 - ci) / 2), schema=CLAIM_TESTS_SCHEMA)


def _rows(effects: Effects, claim: Claim, null: str, ci: float) -> list[dict[str, object]]:
    """Per (subject, class): a row per layer over its models, and one over its layers and models."""
    rows = []
    test_margin = claim.tests[null].margin
    margin = test_margin if test_margin is not None else claim.margin
    for (subject, fn), by_model in sorted(effects.items()):
        cell = (subject, fn, claim.name, null, margin)
        for layer in sorted({layer for layers in by_model.values() for layer in layers}):
            at_layer = [layers[layer] for layers in by_model.values() if layer in layers]
            rows.append(_row(*cell, "layer", layer, at_layer, 1, ci))
        over_layers = [mean_over_layers(list(layers.values())) for layers in by_model.values()]
        n_layers = len({layer for layers in by_model.values() for layer in layers})
        rows.append(_row(*cell, "stratified", None, over_layers, n_layers, ci))
    return rows


def _applies(claim: Claim, fn: str) -> bool:
    """Whether a claim is tested on the strata of `fn`: a trade-off pair's strata for the trade-off alone, a
    layer-wide fit's for none (it is the locality claim's baseline, a column of its local class's strata)."""
    if fn.endswith(LAYER_FIT):
        return False
    if VERSUS in fn or claim.classes == "versus":
        return VERSUS in fn and claim.classes == "versus"
    if fn not in FIT_CLASSES:
        return True
    fit_class = FIT_CLASSES[fn]
    return fit_class.local if claim.classes == "local" else fit_class.tokenwise


def mean_over_layers(effects: list[Effect]) -> Effect:
    """One model's effect over its layers: the mean of the layers' effects and of their blocks' (a block
    without an effect at a layer is left out of its mean there)."""
    mean = lambda values: float(np.mean(values))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a block with no effect at any layer: NaN, silently
        groups = np.nanmean([e.groups for e in effects], axis=0)
    return Effect(
        mean([e.statistic for e in effects]),
        mean([e.null for e in effects]),
        mean([e.effect for e in effects]),
        groups,
        sum(e.n for e in effects),
    )


@dataclass(frozen=True)
class Interval:
    """An effect's Student-t interval and one-sided p-values from its replicates (module docstring)."""

    centre: float
    low: float
    high: float
    unit: str
    n_units: int
    p: dict[str, float]  # P_COLUMNS -> unadjusted p


def t_interval(effects: list[Effect], margin: float, ci: float) -> Interval:
    """Over ≥ 2 models: their effects' mean and t-interval. One model: its effect, and the t-interval of its
    anchor blocks' effects around it (SE = the blocks' SD over √blocks). Fewer than two replicates: NaN."""
    from scipy.stats import t

    if len(effects) >= 2 or not np.isfinite(effects[0].groups).any():  # a subject of several models: its seeds
        replicates = np.array([e.effect for e in effects])
        centre, unit = float(replicates.mean()), SEED
    else:
        replicates, centre, unit = effects[0].groups[np.isfinite(effects[0].groups)], effects[0].effect, ANCHOR_GROUP
    n = len(replicates)
    if n < 2 or not math.isfinite(centre):
        return Interval(centre, math.nan, math.nan, unit, n, dict.fromkeys(P_COLUMNS, math.nan))
    se = float(np.std(replicates, ddof=1)) / math.sqrt(n)
    half = float(t.ppf(0.5 + ci / 2, n - 1)) * se

    def above(h0: float) -> float:  # P(effect ≤ h0 gives a centre this high)
        return float(t.sf((centre - h0) / se, n - 1)) if se > 0 else float(centre <= h0)

    def below(h0: float) -> float:
        return float(t.cdf((centre - h0) / se, n - 1)) if se > 0 else float(centre >= h0)

    p = {"p_above": above(0.0), "p_below": below(0.0), "p_above_margin": above(margin), "p_below_margin": below(margin)}
    return Interval(centre, centre - half, centre + half, unit, n, p)


def _row(
    subject: str,
    fn: str,
    claim: str,
    null: str,
    margin: float,
    scope: str,
    layer: int | None,
    effects: list[Effect],
    n_layers: int,
    ci: float,
) -> dict[str, object]:
    interval = t_interval(effects, margin, ci)
    mean = lambda values: float(np.mean(values))  # noqa: E731
    return {
        "subject": subject,
        "fn": fn,
        "claim": claim,
        "null": null,
        "scope": scope,
        "layer": layer,
        "n_models": len(effects),
        "n_layers": n_layers,
        "n": sum(e.n for e in effects),
        "unit": interval.unit,
        "n_units": interval.n_units,
        "statistic": mean([e.statistic for e in effects]),
        "null_statistic": mean([e.null for e in effects]),
        "effect": interval.centre,
        "ci_low": interval.low,
        "ci_high": interval.high,
        **interval.p,
        "margin": margin,
    }


def _read(rows: list[dict[str, object]], alpha: float) -> list[dict[str, object]]:
    """Holm-adjust each one-sided p-value over the rows of one summary cell (subject, claim, scope, layer: its
    voting classes and nulls; the other rows over themselves alone), then read each row's verdict at `alpha`."""
    cells: dict[tuple[object, ...] | int, list[dict[str, object]]] = {}
    for r in rows:
        key: tuple[object, ...] | int = (
            (r["subject"], r["claim"], r["scope"], r["layer"]) if votes(str(r["fn"])) else id(r)
        )
        cells.setdefault(key, []).append(r)
    for members in cells.values():
        for column in P_COLUMNS:
            for r, adjusted in zip(members, holm([float(m[column]) for m in members]), strict=True):  # type: ignore[arg-type]
                r[column] = adjusted
    for r in rows:
        below, above_margin, below_margin = (float(r[c]) for c in P_COLUMNS[1:])  # type: ignore[arg-type]
        r["verdict"] = verdict(below, above_margin, below_margin, alpha)
    return rows


def votes(fn: str) -> bool:
    """Whether a class's verdict counts in a claim's summary: a local class of the paper's (not a diagnostic,
    not a baseline); for a trade-off pair, its linear class's."""
    if VERSUS in fn:
        return votes(fn.split(VERSUS)[1])
    if fn.endswith(LAYER_FIT):
        return False
    return fn not in FIT_CLASSES or (FIT_CLASSES[fn].local and not FIT_CLASSES[fn].diagnostic)


def is_diagnostic(fn: str) -> bool:
    """A class (or trade-off pair) reported beside the paper's classes, not voting."""
    fn = fn.split(VERSUS)[-1]
    return fn in FIT_CLASSES and FIT_CLASSES[fn].diagnostic


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


def summarise(tests: Sequence[dict[str, object]], voting: Callable[[str], bool] = votes) -> list[ClaimSummary]:
    """Per (subject, claim), in `CLAIMS` order, from the stratified rows of the `claim_tests` table, over the
    classes `voting` admits (by default the paper's: `votes`)."""
    groups: dict[tuple[str, str], list[dict[str, object]]] = {}
    for t in tests:
        if t["scope"] == "stratified" and voting(str(t["fn"])):
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
