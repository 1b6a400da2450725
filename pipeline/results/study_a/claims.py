"""Study A's claims as tests against nulls (SPEC §4.4, §4.5).

Each claim of the seed is a statistic of a (model, layer, class) stratum's anchors and a *null*: the same
statistic on a null sample (the fits on `shuffled` pairs, on the `gaussian` pool), on a null patch
(`kl_random`, `kl_other`), or zero where the statistic is itself an effect. The effect is statistic − null,
signed so that positive is the claim's direction; its 95% interval is a percentile bootstrap over anchors
(paired: an anchor is drawn with its real and its null values). A layer's effect over several models (the
seeds of one architecture at one checkpoint) and an architecture's over layers are *stratified*: the mean of
the strata's effects, each stratum resampled on its own, so rows of different layers are never ranked
together.

Verdict of an effect e with interval [lo, hi] and the claim's margin m (the smallest effect worth the name):
supported when lo > 0 and e ≥ m (in the claimed direction beyond chance, and of a size that counts); not
supported when hi < m (no effect of that size in the claimed direction); inconclusive otherwise. A stratum
with fewer than `MIN_ANCHORS` complete anchors is left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.results.stats import spearman_rows
from pipeline.study_a.classes import FIT_CLASSES

MIN_ANCHORS = 10
SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"

Columns = dict[str, np.ndarray]  # one stratum's per-anchor values: "<column>" real, "<sample>.<column>" null
Statistic = Callable[[Columns, np.ndarray], np.ndarray]  # (columns, index rows (B, n)) -> (B,) statistics


def _median(column: str) -> Statistic:
    return lambda c, idx: np.median(c[column][idx], axis=-1)


def _median_difference(a: str, b: str) -> Statistic:
    return lambda c, idx: np.median(c[a][idx] - c[b][idx], axis=-1)


def _spearman(x: str, y: str) -> Statistic:
    return lambda c, idx: spearman_rows(c[x][idx], c[y][idx])


def _partial_spearman(x: str, y: str, z: str) -> Statistic:
    """Spearman of x and y with z partialled out: the partial correlation of the ranks."""

    def stat(c: Columns, idx: np.ndarray) -> np.ndarray:
        xy, xz, yz = (spearman_rows(c[a][idx], c[b][idx]) for a, b in ((x, y), (x, z), (y, z)))
        with np.errstate(invalid="ignore", divide="ignore"):
            return (xy - xz * yz) / np.sqrt((1 - xz**2) * (1 - yz**2))

    return stat


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
    classes: str = "tokenwise"  # "tokenwise" (every class but identity) or "local"


def _geometric(name: str, text: str, columns: tuple[str, ...], margin: float, seed_value: str) -> Claim:
    """A median (of one column, or of the difference of two) against the same on each null sample."""

    def stat(prefix: str) -> Statistic:
        names = [prefix + c for c in columns]
        return _median(names[0]) if len(names) == 1 else _median_difference(*names)

    tests = {
        sample: Test(stat(""), stat(f"{sample}."), columns + tuple(f"{sample}.{c}" for c in columns))
        for sample in ("shuffled", "gaussian")
    }
    return Claim(name, text, tests, margin, seed_value)


def _patch(null: str) -> str:
    return f"kl_{null}"


CLAIMS: tuple[Claim, ...] = (
    _geometric("cos_full_tok_near_1", "the full update is aligned with its tokenwise part (median cos_full_tok)",
               ("cos_full_tok",), 0.05, "near 1"),
    _geometric("angle_res_tok_large", "the residual lies at a large angle to the tokenwise part "
               "(median angle_res_tok, °)", ("angle_res_tok",), 5.0, "often > 60°"),
    _geometric("proj_res_below_full", "the residual projects less than the full update on the dominant local "
               "tokenwise subspace (median proj_full − proj_res)", ("proj_full", "proj_res"), 0.05,
               "significantly lower"),
    _geometric("proj_res_global_below_full", "the same on the layer's global tokenwise subspace "
               "(median proj_full_global − proj_res_global)", ("proj_full_global", "proj_res_global"), 0.05,
               "significantly lower"),
    Claim("spearman_rel_err_kl", "the residual's size predicts the output change: Spearman(rel_err, kl) against "
          "Spearman(rel_err, kl of a null patch of the same norm)",
          {null: Test(_spearman("rel_err", "kl"), _spearman("rel_err", _patch(null)), ("rel_err", "kl", _patch(null)))
           for null in ("random", "other")}, 0.1, "> 0.7, up to 0.95"),
    Claim("partial_spearman_rel_err_kl", "the same with the residual's size relative to the state (rel_err_state) "
          "partialled out: partial Spearman(rel_err, kl | rel_err_state), against 0",
          {"zero": Test(_partial_spearman("rel_err", "kl", "rel_err_state"), None, ("rel_err", "kl", "rel_err_state"))},
          0.1, "(not reported)"),
    Claim("residual_outweighs_null", "removing the real residual moves the output more than removing a null "
          "residual of the same norm: median log(kl / kl_null), against 0",
          {null: Test(_median_log_ratio("kl", _patch(null)), None, ("kl", _patch(null)))
           for null in ("random", "other")},
          math.log(1.25), "the residual is functionally decisive"),
    Claim("local_beats_global", "local tokenwise maps explain more than one global affine map, out of sample: "
          "median rel_err(global_linear, left out) − rel_err(class), against 0",
          {"zero": Test(_median_difference("global.rel_err", "rel_err"), None, ("rel_err", "global.rel_err"))}, 0.05,
          "(assumed: the fits are local)", classes="local"),
)
CLAIM_NAMES = tuple(c.name for c in CLAIMS)


# ------------------------------------------------------------------------------------- the tests
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


def verdict(effect: float, low: float, high: float, margin: float) -> str:
    if not (math.isfinite(low) and math.isfinite(high)):
        return INCONCLUSIVE
    if low > 0 and effect >= margin:
        return SUPPORTED
    return NOT_SUPPORTED if high < margin else INCONCLUSIVE


def combined_verdict(verdicts: Sequence[str]) -> str:
    """Over a claim's nulls: supported against every null, not supported against any, else inconclusive."""
    if verdicts and all(v == SUPPORTED for v in verdicts):
        return SUPPORTED
    return NOT_SUPPORTED if NOT_SUPPORTED in verdicts else INCONCLUSIVE


CLAIM_TESTS_SCHEMA = pa.schema(
    [("subject", pa.string()), ("fn", pa.string()), ("claim", pa.string()), ("null", pa.string()),
     ("scope", pa.string()), ("layer", pa.int32()), ("n_models", pa.int64()), ("n_layers", pa.int64()),
     ("n", pa.int64()), ("statistic", pa.float64()), ("null_statistic", pa.float64()), ("effect", pa.float64()),
     ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("margin", pa.float64()), ("verdict", pa.string())]
)  # fmt: skip


def claim_tests(strata: Sequence[Stratum], n_boot: int, ci: float, seed: int) -> pa.Table:
    """Every claim against each of its nulls: per (subject, class, layer) over the subject's models
    (scope `layer`), and over its layers and models (scope `stratified`)."""
    rows = []
    for claim in CLAIMS:
        for null, test in claim.tests.items():
            effects: dict[tuple[str, str], list[tuple[int, Replicates]]] = {}
            models = sorted({s.model for s in strata})
            for s in strata:
                if not _applies(claim, s.fn):
                    continue
                # One draw per model: a model's layers share their anchors, so where a layer keeps them all
                # its resample is the same anchors' (they are not independent across layers).
                rep = stratum_effect(s, test, n_boot, seed + models.index(s.model))
                if rep is not None:
                    effects.setdefault((s.subject, s.fn), []).append((s.layer, rep))
            for (subject, fn), reps in sorted(effects.items()):
                for layer in sorted({layer for layer, _ in reps}):
                    at_layer = [r for lay, r in reps if lay == layer]
                    rows.append(_row(subject, fn, claim, null, "layer", layer, at_layer, ci, 1))
                rows.append(_row(subject, fn, claim, null, "stratified", None, [r for _, r in reps], ci,
                                 len({lay for lay, _ in reps})))
    return pa.Table.from_pylist(rows, schema=CLAIM_TESTS_SCHEMA)


def _applies(claim: Claim, fn: str) -> bool:
    if fn not in FIT_CLASSES:
        return True
    fit_class = FIT_CLASSES[fn]
    return fit_class.local if claim.classes == "local" else fit_class.tokenwise


def _row(subject: str, fn: str, claim: Claim, null: str, scope: str, layer: int | None, reps: list[Replicates],
         ci: float, n_layers: int) -> dict[str, object]:  # fmt: skip
    boot = np.mean([r.boot for r in reps], axis=0)
    finite = boot[np.isfinite(boot)]
    low, high = (np.percentile(finite, [50 * (1 - ci), 50 * (1 + ci)]) if finite.size else (np.nan, np.nan))
    mean = lambda values: float(np.mean(values))  # noqa: E731
    return {
        "subject": subject, "fn": fn, "claim": claim.name, "null": null, "scope": scope, "layer": layer,
        "n_models": len(reps) // n_layers, "n_layers": n_layers, "n": sum(r.n for r in reps),
        "statistic": mean([r.statistic for r in reps]), "null_statistic": mean([r.null for r in reps]),
        "effect": mean([r.effect for r in reps]), "ci_low": float(low), "ci_high": float(high),
        "margin": claim.margin,
        "verdict": verdict(mean([r.effect for r in reps]), float(low), float(high), claim.margin),
    }  # fmt: skip


# ----------------------------------------------------------------------------------- the headline
VERDICT_SCORE = {SUPPORTED: 1.0, INCONCLUSIVE: 0.0, NOT_SUPPORTED: -1.0}
_STRENGTH = {NOT_SUPPORTED: 0, INCONCLUSIVE: 1, SUPPORTED: 2}


@dataclass(frozen=True)
class ClaimSummary:
    """One claim for one subject (`<arch>@<checkpoint>` or a model id), over the classes it applies to:
    each class's verdict (over the claim's nulls, `combined_verdict`) and the test that decides the weakest
    of them, the one the headline shows (a `claim_tests` row at scope `stratified`)."""

    subject: str
    claim: str
    verdicts: dict[str, str]  # class -> combined verdict
    weakest: dict[str, object]

    @property
    def score(self) -> float:
        """+1 supported, 0 inconclusive, −1 not supported, averaged over the classes: one number that
        `dvc metrics diff` can compare across experiments."""
        return float(np.mean([VERDICT_SCORE[v] for v in self.verdicts.values()]))

    @property
    def verdict(self) -> str:
        """The verdict where every class agrees, else `mixed` with the count of each."""
        distinct = set(self.verdicts.values())
        if len(distinct) == 1:
            return distinct.pop()
        counts = {v: list(self.verdicts.values()).count(v) for v in (SUPPORTED, INCONCLUSIVE, NOT_SUPPORTED)}
        return "mixed: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)


def summarise(tests: Sequence[dict[str, object]]) -> list[ClaimSummary]:
    """Per (subject, claim), in `CLAIMS` order, from the stratified rows of the `claim_tests` table."""
    groups: dict[tuple[str, str], list[dict[str, object]]] = {}
    for t in tests:
        if t["scope"] == "stratified":
            groups.setdefault((str(t["subject"]), str(t["claim"])), []).append(t)
    out = []
    for (subject, claim), rows in sorted(groups.items(), key=lambda g: (g[0][0], CLAIM_NAMES.index(g[0][1]))):
        by_class: dict[str, list[str]] = {}
        for r in rows:
            by_class.setdefault(str(r["fn"]), []).append(str(r["verdict"]))
        # The deciding test: the weakest verdict, then the lowest interval (a missing one counts as lowest).
        weakest = min(rows, key=lambda r: (_STRENGTH[str(r["verdict"])], _finite_or_low(r["ci_low"])))
        verdicts = {fn: combined_verdict(vs) for fn, vs in sorted(by_class.items())}
        out.append(ClaimSummary(subject, claim, verdicts, weakest))
    return out


def _finite_or_low(x: object) -> float:
    return float(x) if isinstance(x, float) and math.isfinite(x) else -math.inf
