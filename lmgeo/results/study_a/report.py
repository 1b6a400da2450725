"""Study A's part of the report (`lmgeo.results.report`): the paper's claims in the summary (in words, the
heat map, what reproduces beside what is specific against a null, the numbers, and the project's own checks
apart) and its one-sentence finding, and the section with the models, the trade-off, init vs trained, the
locality sweep and the functional claim's figure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from lmgeo.results.common import Figures, Row, Tables, interval, markdown_table, median, num
from lmgeo.results.study_a import figures as fig
from lmgeo.results.study_a.claims import (
    ANCHOR_GROUP,
    CLAIMS,
    SUPPORTED,
    VERSUS,
    Claim,
    ClaimSummary,
    combined_verdict,
    is_diagnostic,
    subject_of,
    summarise,
    votes,
    well_posed,
)
from lmgeo.study_a.classes import FIT_CLASSES

NULL_TEXT = {
    "shuffled": "shuffled pairs",
    "gaussian": "Gaussian pool",
    "random": "random directions",
    "other": "other anchor's residual",
    "zero": "0",
    "rel_err": "rel_err",
    "spearman": "spearman",
}
CLAIMS_BY_NAME = {claim.name: claim for claim in CLAIMS}
PAPER = [c for c in CLAIMS if c.source == "paper"]
PROJECT = [c for c in CLAIMS if c.source == "project"]
INTERVALS = (
    "95% Student-t interval over the seeds' effects (a model with no seeds: over five blocks of its "
    "anchors), nothing drawn at random"
)
READING = (
    "*Supported*: above the claim's margin beyond chance (the lower end of the interval, Holm-adjusted over "
    "the cell's classes and nulls, above the margin); *not supported*: below the margin beyond chance (any "
    "effect too small to count); *contradicted*: below 0 beyond chance; *inconclusive*: otherwise."
)


def claims_summary(
    claims: list[ClaimSummary],
    geometry: list[Row],
    tests: list[Row],
    figures: Figures,
    paper_values: Sequence[Row] = (),
) -> str:
    """The paper's claims for a newcomer: a sentence per claim with its verdict per architecture (and external
    model), the claims × layers heat map under them, what reproduces beside what is specific against a null,
    then the table with the test that decides each verdict, and the project's own checks apart."""
    trained = [c for c in claims if not c.subject.endswith("@init")]
    if not trained:
        why = (
            "no claim could be tested (no null samples, no layer with 10·k distinct inputs, or fewer than 10 "
            "complete anchors per layer)"
            if geometry
            else "Study A was not run (no fits)"
        )
        return f"**Study A (the paper's claims)**: not measured: {why}, so the data says nothing about the claims.\n"
    sentences = "\n".join(
        _claim_sentence(claim, [c for c in trained if c.claim == claim.name])
        for claim in PAPER
        if any(c.claim == claim.name for c in trained)
    )
    ill_posed = {(subject_of(model), layer) for model, layer in _ill_posed_pools(geometry)}
    heat_map = figures.show(
        fig.claims_by_layer(tests, ill_posed),
        "study_a_claims_by_layer",
        "Where each claim holds, layer by layer (rows: the claims above; a panel per model, "
        "`@final` after training, `@init` at initialisation). Blue: supported, orange: not "
        "supported, dark red: contradicted, grey: the data cannot decide; pale: the fit classes "
        "disagree, leaning that way; hatched: not well posed (left out of every claim); blank: "
        "not tested.",
    )
    diagnostic = {(c.subject, c.claim): c for c in summarise(tests, voting=is_diagnostic)}
    return "\n".join(
        [
            sentences + "\n",
            heat_map,
            _side_by_side(claims, paper_values),
            CLAIMS_HEAD,
            _claims_table(trained, PAPER, diagnostic),
            _extra_checks(trained, diagnostic),
        ]
    )


def _claim_sentence(claim: Claim, summaries: list[ClaimSummary]) -> str:
    """`claim.plain`, then the subjects grouped by their verdict in words."""
    where: dict[str, list[str]] = {}
    for c in summaries:
        where.setdefault(_verdict_in_words(c), []).append(c.subject.removesuffix("@final"))
    verdicts = "; ".join(f"{', '.join(subjects)}: **{words}**" for words, subjects in where.items())
    return f"- {claim.plain} ({verdicts})"


def _verdict_in_words(c: ClaimSummary) -> str:
    if len(set(c.verdicts.values())) == 1:
        return c.verdict
    supporting = sum(v == SUPPORTED for v in c.verdicts.values())
    what = "comparisons" if any(VERSUS in fn for fn in c.verdicts) else "classes"
    return f"mixed: {supporting} of {len(c.verdicts)} {what} support it"


def finding(claims: list[ClaimSummary]) -> str | None:
    """Study A in one sentence: how many of the paper's claims hold on every trained architecture, on some, on
    none; the effect over the null of each claim that holds somewhere; then the project's own checks, named as
    such (README's findings)."""
    trained = [c for c in claims if c.subject.endswith("@final")]
    if not trained:
        return None
    subjects = sorted({c.subject.removesuffix("@final") for c in trained})
    supported = {
        claim.name: sum(c.verdict == SUPPORTED for c in trained if c.claim == claim.name)
        for claim in PAPER
        if any(c.claim == claim.name for c in trained)
    }
    every = [CLAIMS_BY_NAME[n].label for n, k in supported.items() if k == len(subjects)]
    none = [n for n, k in supported.items() if k == 0]
    some = len(supported) - len(every) - len(none)
    partly = sum(any(v == SUPPORTED for c in trained if c.claim == n for v in c.verdicts.values()) for n in none)

    def named(labels: list[str]) -> str:
        return f"{len(labels)} ({', '.join(f'“{label}”' for label in labels)})" if labels else "0"

    by_some_classes = f", {partly} of them by some of the fit classes" if partly else ""
    extras = [c for c in trained if CLAIMS_BY_NAME[c.claim].source == "project"]
    checks = "; ".join(
        f"“{CLAIMS_BY_NAME[name].label}” {_across(extras, name, subjects)}"
        for name in dict.fromkeys(c.claim for c in extras)
    )
    own = f" The project's own checks, not the paper's claims: {checks}." if checks else ""
    return (
        f"Study A, on the small models trained here ({', '.join(subjects)}), the paper's {len(supported)} claims: "
        f"{named(every)} supported on every architecture, {some} on some, "
        f"{named([CLAIMS_BY_NAME[n].label for n in none])} on none{by_some_classes}."
        f"{_effects(trained, [n for n, k in supported.items() if k])}{own}"
    )


TOKENWISE = "cos_full_tok_near_1"  # the paper's first claim: a layer's update follows its tokenwise part


def meaning(claims: list[ClaimSummary]) -> str | None:
    """Study A in plain words: does a layer's update follow a tokenwise map fitted on nearby tokens (the paper's
    first claim), and is what that map misses the residual the paper describes (its other claims)? "Supported"
    as the headline reads it: by every voting class."""
    parts = meanings(claims)
    if not parts:
        return None
    along = parts[0].startswith("a layer's update follows")
    joined = f", {'but' if along and parts[-1].startswith('none of') else 'and'} ".join(parts)
    return f"Study A in plain words: on these small models {joined}."


def meanings(claims: list[ClaimSummary]) -> list[str]:
    """`meaning`'s findings, one clause each (lower case, no full stop): the report's list."""
    trained = [c for c in claims if c.subject.endswith("@final") and CLAIMS_BY_NAME[c.claim].source == "paper"]
    along = sorted(c.subject.removesuffix("@final") for c in trained if c.claim == TOKENWISE and c.verdict == SUPPORTED)
    about_rest = list(dict.fromkeys(c.claim for c in trained if c.claim != TOKENWISE))
    held = [name for name in about_rest if any(c.verdict == SUPPORTED for c in trained if c.claim == name)]
    parts = []
    if any(c.claim == TOKENWISE for c in trained):
        where = f"({', '.join(along)})"
        parts.append(
            f"a layer's update follows what a tokenwise map fitted on nearby tokens predicts {where}"
            if along
            else "no layer update is shown to follow what a tokenwise map fitted on nearby tokens predicts"
        )
    if held:
        labels = ", ".join(f"“{CLAIMS_BY_NAME[name].label}”" for name in held)
        parts.append(
            f"{len(held)} of the paper's {len(about_rest)} claims about what that map misses "
            f"{'holds' if len(held) == 1 else 'hold'} somewhere ({labels})"
        )
    elif about_rest:
        parts.append(
            f"none of the paper's {len(about_rest)} claims about what that map misses is supported on any architecture"
        )
    return parts


def _effects(trained: list[ClaimSummary], names: list[str]) -> str:
    """The effect over the null of each of `names` per architecture: its deciding test (the weakest class's)."""
    if not names:
        return ""
    parts = []
    for name in names:
        per_arch = ", ".join(
            f"{c.subject.removesuffix('@final')} {_effect(c.weakest)}" for c in trained if c.claim == name
        )
        parts.append(f"“{CLAIMS_BY_NAME[name].label}” {per_arch} (margin {num(CLAIMS_BY_NAME[name].margin, 2)})")
    return (
        " Effect over the null where a claim holds (the deciding test, the weakest class's; 95% CI): "
        f"{'; '.join(parts)}."
    )


def _effect(test: Row) -> str:
    return interval(test["effect"], test["ci_low"], test["ci_high"], 2)


def _across(summaries: list[ClaimSummary], claim: str, subjects: list[str]) -> str:
    """Where a claim is supported, in words: `supported on every architecture`, `on a, b`, or `on none`."""
    where = [c.subject.removesuffix("@final") for c in summaries if c.claim == claim and c.verdict == SUPPORTED]
    return (
        "supported on every architecture"
        if len(where) == len(subjects)
        else f"supported on {', '.join(where)}"
        if where
        else "supported on none"
    )


def _claims_table(
    trained: list[ClaimSummary], claims: list[Claim], diagnostic: dict[tuple[str, str], ClaimSummary]
) -> str:
    """One row per claim, one column per trained architecture (and external model): the verdict over the
    paper's classes, the test that decides it (statistic vs null, effect with its CI), and the diagnostic
    class's verdict beside it."""
    subjects = sorted({c.subject for c in trained})
    at = {(c.subject, c.claim): c for c in trained}
    layers = {s: max(n for c in trained if c.subject == s for n in c.layers.values()) for s in subjects}
    rows = []
    for claim in claims:
        if any((s, claim.name) in at for s in subjects):
            cells = [_claim_cell(at.get((s, claim.name)), layers[s], diagnostic.get((s, claim.name))) for s in subjects]
            rows.append([f"{claim.label} (`{claim.name}`; paper: {claim.seed_value})", *cells])
    return markdown_table(["claim"] + [s.removesuffix("@final") for s in subjects], rows) if rows else ""


CLAIMS_HEAD = (
    f"The numbers: each claim against its null over layers and seeds (stratified, never pooled), with its "
    f"{INTERVALS}. A cell gives the verdict over the paper's classes (`diag_psd`, `lowrank`, `similarity`, "
    "`mlp`; each must pass every null; `global_linear` and the layer-wide fits are baselines), then the "
    "test that decides it: statistic vs null → effect [CI] (class, null; the layers, seeds and anchors "
    "it rests on), and the unscaled `orthogonal` map's verdict, a diagnostic that does not vote. "
    f"{READING} `init` and the per-class tests are in Study A below.\n"
)


def _extra_checks(trained: list[ClaimSummary], diagnostic: dict[tuple[str, str], ClaimSummary]) -> str:
    """The project's own checks, apart from the paper's claims, in the same form."""
    table = _claims_table(trained, PROJECT, diagnostic)
    if not table:
        return ""
    return (
        "**The project's own checks** (not claims of the paper, so not in its count): whether the residual's "
        "size predicts the output change beyond its size relative to the state, and whether fitting per "
        "neighbourhood beats one fit per layer.\n\n" + table
    )


def _claim_cell(c: ClaimSummary | None, layers: int, diagnostic: ClaimSummary | None = None) -> str:
    """The verdict, the deciding test and what it rests on; a class whose verdict rests on fewer than half
    of the subject's `layers` is named (the others' anchors were not identified there)."""
    if c is None:
        return "not measured"
    t = c.weakest
    effect = _effect(t)
    null = NULL_TEXT.get(str(t["null"]), t["null"])
    versus = f"{num(t['statistic'], 2)} vs {num(t['null_statistic'], 2)}"
    units = f"one model, {t['n_units']} anchor blocks" if t.get("unit") == ANCHOR_GROUP else f"{t['n_models']} seeds"
    rests = f"{t['n_layers']} layers, {units}, {t['n']} anchors"
    few = [f"{fn} on {n} of {layers} layers" for fn, n in c.layers.items() if 2 * n < layers]
    warning = f" · **{'; '.join(few)}**" if few else ""
    beside = f" · orthogonal (diagnostic): {diagnostic.verdict}" if diagnostic else ""
    return f"**{c.verdict}** · {versus} → {effect} ({t['fn']}, {null}; {rests}){warning}{beside}"


# ------------------------------------------------------------------------- what reproduces, side by side
def _side_by_side(claims: list[ClaimSummary], values: Sequence[Row]) -> str:
    """Each statistic of the paper as the paper states it, the raw value measured here, and the verdict and
    deciding effect against the fair null: "reproduces at this scale" and "specific against a null" read apart."""
    trained = sorted({c.subject for c in claims if not c.subject.endswith("@init")})  # and external models
    if not trained or not values:
        return ""
    at = {(c.subject, c.claim): c for c in claims}
    raw = _raw_values(values)
    at_init = any(c.subject.endswith("@init") for c in claims)
    rows = []
    for statement, show, claim in SIDE_BY_SIDE:
        if show is _with_training and not at_init:  # an external model has no initialisation to compare with
            continue
        cells = []
        for subject in trained:
            cells.append(show(raw, subject, at))
            summary = at.get((subject, claim)) if claim else None
            cells.append(_null_cell(summary) if claim else "–")
        rows.append([statement, *cells])
    header = ["the paper states"] + [
        f"{s.removesuffix('@final')}: {part}" for s in trained for part in ("here (raw)", "vs fair null")
    ]
    where = "the small models trained here" if at_init else "the models analysed here"
    note = (
        f"*Here (raw)*: the statistic as the paper states it, on {where} (range over the "
        "paper's classes `diag_psd`, `lowrank`, `similarity`, `mlp`: the mean over layers, then seeds); *vs fair "
        "null*: the claim's verdict and its deciding effect [95% CI] against a null that gives 0 where the "
        "structure is absent. A raw value can match the paper while the effect shows nothing specific, and the "
        "other way round.\n"
    )
    return "**What reproduces, and what is specific against a null.**\n\n" + markdown_table(header, rows) + "\n" + note


def _null_cell(c: ClaimSummary | None) -> str:
    if c is None:
        return "not measured"
    t = c.weakest
    return f"**{c.verdict}** · {interval(t['effect'], t['ci_low'], t['ci_high'], 2)}"


RawValues = dict[tuple[str, str, str], float]  # (subject, class, statistic) -> value
SummaryAt = dict[tuple[str, str], ClaimSummary]  # (subject, claim) -> its summary


def _raw_values(values: Sequence[Row]) -> RawValues:
    return {(v["subject"], v["fn"], v["statistic"]): v["value"] for v in values if v["value"] is not None}


def _range(
    raw: RawValues,
    subject: str,
    statistic: str,
    scale: float = 1.0,
    digits: int = 2,
    classes: Sequence[str] | None = None,
) -> str:
    """The statistic's range over the paper's classes (or `classes`) for `subject`, `low–high`."""
    found = [raw[(subject, fn, statistic)] * scale for fn in (classes or VOTING) if (subject, fn, statistic) in raw]
    if not found:
        return "–"
    low, high = min(found), max(found)
    return num(low, digits) if num(low, digits) == num(high, digits) else f"{num(low, digits)}–{num(high, digits)}"


VOTING = [c.name for c in FIT_CLASSES if c.local and c.tokenwise and votes(c.name)]
LINEAR = [fn for fn in VOTING if FIT_CLASSES[fn].linear]
NONLINEAR = [fn for fn in VOTING if not FIT_CLASSES[fn].linear]


def _supported_count(at: SummaryAt, subject: str) -> str:
    """How many of the paper's claims `subject` supports, of those tested (– for none: an external model has no
    initialisation)."""
    tested = [at[(subject, c.name)] for c in PAPER if (subject, c.name) in at]
    return f"{sum(c.verdict == SUPPORTED for c in tested)} of {len(tested)}" if tested else "–"


def _cos(r: RawValues, s: str, at: SummaryAt) -> str:
    return f"median absolute cos(Δ_full, Δ_tok) {_range(r, s, 'cos_full_tok')}"


def _angle(r: RawValues, s: str, at: SummaryAt) -> str:
    return f"{_range(r, s, 'angle_over_60', 100, 2)}% of anchors > 60°"


def _projection(r: RawValues, s: str, at: SummaryAt) -> str:
    return f"median projection: residual {_range(r, s, 'proj_res')} vs full update {_range(r, s, 'proj_full')}"


def _rank_correlation(r: RawValues, s: str, at: SummaryAt) -> str:
    return (
        f"Spearman ρ {_range(r, s, 'spearman')} (max {_range(r, s, 'spearman_max')}; > 0.7 in "
        f"{_range(r, s, 'spearman_over_0.7', 100, 2)}% of layers)"
    )


def _decisive(r: RawValues, s: str, at: SummaryAt) -> str:
    return f"outweighs {_range(r, s, 'outweighs_random', 100, 2)}% of random directions"


def _mlp_against_linear(r: RawValues, s: str, at: SummaryAt) -> str:
    parts = [
        f"{label} {_range(r, s, name, classes=NONLINEAR)} vs {_range(r, s, name, classes=LINEAR)}"
        for name, label in (("rel_err", "residual size (rel_err)"), ("spearman", "Spearman ρ"))
    ]
    return f"MLP vs linear: {'; '.join(parts)}"


def _diagonal(r: RawValues, s: str, at: SummaryAt) -> str:
    return (
        f"residual size (rel_err): diag_psd {_range(r, s, 'rel_err', classes=['diag_psd'])} vs lowrank "
        f"{_range(r, s, 'rel_err', classes=['lowrank'])} (one model size here: not a comparison of sizes)"
    )


def _with_training(r: RawValues, s: str, at: SummaryAt) -> str:
    return (
        f"claims supported after training {_supported_count(at, s)}, at initialisation "
        f"{_supported_count(at, s.replace('@final', '@init'))}"
    )


# (the paper's statement, its raw value here, the claim tested against a fair null or None)
SIDE_BY_SIDE: tuple[tuple[str, Callable[[RawValues, str, SummaryAt], str], str | None], ...] = (
    ("cos(Δ_full, Δ_tok) near 1", _cos, "cos_full_tok_near_1"),
    ("the residual's angle to Δ_tok often > 60°", _angle, "angle_res_tok_near_90"),
    ("a lower projection for the residual on the dominant subspace", _projection, "proj_res_below_full"),
    ("Spearman(RelErr, KL) strong: often > 0.7, up to 0.95", _rank_correlation, "spearman_rel_err_kl"),
    ("the residual is functionally decisive", _decisive, "residual_outweighs_null"),
    (
        "small MLPs instead of linear maps: a smaller residual, a weaker link to KL",
        _mlp_against_linear,
        "expressivity_tradeoff",
    ),
    ("simpler models are fitted well by diagonal maps, larger ones by low-rank", _diagonal, None),
    ("the structure comes with training (intrinsic to learning)", _with_training, None),
)


def section(tables: Tables, claims: list[ClaimSummary], figures: Figures, locality: Sequence[Row] = ()) -> str:
    out = ["## Study A: layer-update geometry\n"]
    if not tables["geometry"]:
        return out[0] + "\nStudy A was not run: there are no fits.\n"
    out.append(
        "Per model and layer a tokenwise map T is fitted on each anchor's nearest neighbours; Δ_full = h_{l+1} − h_l "
        "splits into Δ_tok = T(h_l) − h_l and a residual r (SPEC §4.2). Each claim is tested against nulls that give "
        "0 where the structure is absent (SPEC §4.5): the geometric ones against the same fits on shuffled pairs and "
        "on a Gaussian pool, the functional ones against patches of norm ‖r‖, one at a time, in random directions "
        "or along another anchor's residual. Effect = statistic − null, stratified over layers and seeds, with its "
        f"{INTERVALS}. {READING} Layers whose pool is not well posed are left out of every claim.\n"
    )
    out.append(_models_table(tables["geometry_pooled"], tables["geometry"]))
    out.append(_kept_table(tables["geometry"]))
    out.append(_expressivity(tables["expressivity"], tables["claim_tests"]))
    checkpoints = [c for c in claims if c.subject.endswith(("@init", "@final"))]  # an external model has neither
    if checkpoints:
        out.append("### Init vs trained\n")
        out.append(_init_vs_final(checkpoints))
    out.append(_locality_sweep(locality))
    out.append(
        figures.show(
            fig.spearman_vs_null(tables["claim_tests"]),
            "study_a_spearman_vs_null",
            "Spearman(rel_err, kl) minus the same with one random direction of equal norm (the "
            "mean over directions), per layer, with its 95% t-interval (dotted: the claim's "
            "margin).",
        )
    )
    out.append(
        'Every test per class, null and layer: `lmgeo query "SELECT * FROM claim_tests"` '
        "(`scope = 'stratified'` for the summary's rows).\n"
    )
    return "\n".join(part for part in out if part)


def _local(fn: str) -> bool:
    """A local class's own fit (not its layer-wide baseline)."""
    return fn in FIT_CLASSES and FIT_CLASSES[fn].local


def _models_table(pooled: list[Row], geometry: list[Row]) -> str:
    """One row per distinct model (each distinct initialisation once): how well posed its fits are and what
    was excluded as non-finite; then how well each class fits (`_fits_table`)."""
    real = [g for g in geometry if g["sample"] == "real"]
    rows = []
    for model in sorted({p["model"] for p in pooled}):
        layers = [g for g in real if g["model"] == model]
        classes = [p for p in pooled if p["model"] == model]
        distinct = [g["n_distinct"] for g in layers if g["n_distinct"] is not None]
        rows.append(
            [
                f"`{model}`",
                classes[0]["n_layers"],
                min(distinct) if distinct else None,
                layers[0]["k"],
                f"{min(g['n_value_kept'] / g['n'] for g in layers if _local(g['fn'])):.0%}",
                (
                    f"{max(c['n_nonfinite'] or 0 for c in classes)} pool tokens, "
                    f"{max(c['n_nonfinite_values'] for c in classes)} anchors"
                ),
            ]
        )
    note = (
        "Per distinct model (`@init`: each distinct initialisation once). *distinct inputs*: fewest distinct h_l "
        "in a layer's pool (SPEC asks ≥ 10·k); *kept*: smallest share of anchors in a (layer, local class) whose "
        "value at the anchor is identified (the others are left out; per layer below); *excluded non-finite*: "
        "pool tokens and anchors left out of every statistic.\n"
    )
    header = ["model", "layers", "distinct inputs", "k", "kept", "excluded non-finite"]
    return (
        "### Models\n\n"
        + markdown_table(header, rows, "Per model: its layers, distinct inputs, k, anchors kept, exclusions")
        + "\n"
        + note
        + _ill_posed(real)
        + "\n"
        + _fits_table(pooled, real)
    )


def _fits_table(pooled: list[Row], real: list[Row]) -> str:
    """Per class (rows) and subject (columns, a table that fits a screen): rel_err and cos_full_tok beside the
    bound √(1 − rel_err²) that rel_err alone implies, each the median over the subject's models of its median
    over layers; per model and layer it is a query."""
    fns = list(dict.fromkeys(p["fn"] for p in pooled))
    subjects = sorted({subject_of(p["model"]) for p in pooled})
    rows = []
    for fn in fns:
        row = [f"`{fn}`"]
        for subject in subjects:
            fits = [p for p in pooled if p["fn"] == fn and subject_of(p["model"]) == subject]
            # Aggregated as cos is (over layers, then models), so that cos ≥ bound, true per layer, holds here too.
            bound = median(
                [
                    median([g["median_cos_bound"] for g in real if g["fn"] == fn and g["model"] == p["model"]])
                    for p in fits
                ]
            )
            rel_err = median([p["layer_median_rel_err"] for p in fits])
            cos = median([p["layer_median_cos_full_tok"] for p in fits])
            row.append(f"{num(rel_err, 2)} · {num(cos, 2)} ≥ {num(bound, 2)}" if fits else "–")
        rows.append(row)
    note = (
        "Per class: rel_err · cos_full_tok ≥ √(1 − rel_err²), each the median over layers (both over the same "
        "anchors), then over the subject's models; the bound follows from rel_err alone, so cos_full_tok near 1 "
        'is no evidence beyond a small residual. Per model and layer: `lmgeo query "SELECT model, layer, fn, '
        "median_rel_err, median_cos_full_tok, median_cos_bound FROM geometry WHERE sample = 'real'\"`.\n"
    )
    what = "Each class's relative error and cosine with the update, against the bound, per model and checkpoint"
    return markdown_table(["class: rel_err · cos ≥ bound", *subjects], rows, what) + "\n" + note


def _kept_table(geometry: list[Row]) -> str:
    """Per subject (its seeds pooled) and local class, the share of anchors each layer keeps: with the value
    at the anchor identified (what rel_err, the angle and the KL claims use), and with the local operator
    identified (what proj_* use)."""
    real = [g for g in geometry if g["sample"] == "real" and _local(g["fn"])]
    if not real:
        return ""
    counts: dict[tuple[str, str, int], list[int]] = {}
    for g in real:
        total = counts.setdefault((subject_of(g["model"]), g["fn"], g["layer"]), [0, 0, 0])
        for i, column in enumerate(("n", "n_value_kept", "n_operator_kept")):
            total[i] += g[column] or 0
    subjects = sorted({s for s, _, _ in counts})
    fns = list(dict.fromkeys(g["fn"] for g in real))
    layers = sorted({layer for _, _, layer in counts})

    def cell(subject: str, fn: str) -> str:
        shares = [counts.get((subject, fn, layer)) for layer in layers]
        value = "·".join(f"{100 * c[1] / c[0]:.0f}" if c and c[0] else "–" for c in shares)
        operator = "·".join(f"{100 * c[2] / c[0]:.0f}" if c and c[0] else "–" for c in shares)
        return f"{value} / {operator}" if FIT_CLASSES[fn].tokenwise else value

    locality = _locality(real)
    rows = [
        [
            f"`{subject}`",
            *(cell(subject, fn) for fn in fns),
            "·".join(num(locality.get((subject, layer)), 2) for layer in layers),
        ]
        for subject in subjects
    ]
    measured = [value for value in locality.values() if value is not None]
    spread = f" Here it ranges from {num(min(measured), 2)} to {num(max(measured), 2)}." if measured else ""
    note = (
        f"Anchors kept, % per layer {layers[0]}–{layers[-1]} (seeds pooled): value identified / operator "
        "identified (`identity` has no operator). A claim rests only on the kept anchors. *locality*: per layer, "
        "the median over anchors and seeds of the k-th neighbour's distance over the median distance between "
        "distinct rows of the layer's pool (1: a neighbourhood as wide as the pool's typical spread; near 0: "
        f"local).{spread}\n"
    )
    return "### Anchors kept\n\n" + markdown_table(["subject", *fns, "locality"], rows) + "\n" + note


def _locality(real: list[Row]) -> dict[tuple[str, int], float | None]:
    """Per (subject, layer): the median over its models of `geometry.median_locality` (one value per model
    and layer: every local class shares the neighbour search)."""
    per_model: dict[tuple[str, int], dict[str, float]] = {}
    for g in real:
        if g.get("median_locality") is not None:
            per_model.setdefault((subject_of(g["model"]), g["layer"]), {})[g["model"]] = g["median_locality"]
    return {key: median(list(models.values())) for key, models in per_model.items()}


def _expressivity(classes: list[Row], tests: list[Row]) -> str:
    """One row per local tokenwise class in order of capacity, one column per subject: median rel_err and
    Spearman(rel_err, kl) with their intervals; then a row per trade-off pair (the MLP against each linear class):
    its verdict over the two parts and each part's effect."""
    if not classes:
        return ""
    subjects = sorted({c["subject"] for c in classes})
    at = {(c["subject"], c["fn"]): c for c in classes}
    fns = list(dict.fromkeys(c["fn"] for c in sorted(classes, key=lambda c: (c["parameters"] or 0, c["fn"]))))
    rows = []
    for fn in fns:
        parameters = " / ".join(dict.fromkeys(str(at[(s, fn)]["parameters"]) for s in subjects if (s, fn) in at))
        cells = [_class_cell(at.get((s, fn))) for s in subjects]
        rows.append([f"`{fn}`", parameters, *cells])
    pairs: dict[tuple[str, str], dict[str, Row]] = {}
    for t in tests:
        if VERSUS in t["fn"] and t["scope"] == "stratified":
            pairs.setdefault((t["fn"], t["subject"]), {})[t["null"]] = t
    for pair in sorted({fn for fn, _ in pairs}, key=lambda fn: (is_diagnostic(fn), fn)):
        label = f"**{pair}**" + (" (diagnostic)" if is_diagnostic(pair) else "")
        rows.append([label, "", *(_tradeoff_cell(pairs.get((pair, s), {})) for s in subjects)])
    note = (
        "The paper: small MLPs instead of linear maps shrink the residual but weaken its correlation with KL. "
        "Classes in order of capacity (free parameters of one map at the model's width); a cell: median rel_err · "
        "Spearman(rel_err, kl) on the anchors every class keeps, the mean over layers (never pooled) and seeds, "
        f"with its {INTERVALS}. A pair's row: the MLP against one linear class on the anchors both keep, its "
        "verdict over two parts and each part's effect against 0: *rel_err* the median over anchors of the "
        "linear class's rel_err minus the MLP's (paired per anchor; margin 0.05), *spearman* the linear class's "
        "Spearman(rel_err, kl) minus the MLP's (margin 0.1); supported when both are.\n"
    )
    header = ["class", "parameters", *(f"`{s}`" for s in subjects)]
    return "### Expressivity trade-off\n\n" + markdown_table(header, rows) + "\n" + note


def _class_cell(c: Row | None) -> str:
    if c is None:
        return "–"
    return (
        f"{interval(c['rel_err'], c['rel_err_low'], c['rel_err_high'], 2)} · "
        f"{interval(c['spearman'], c['spearman_low'], c['spearman_high'], 2)}"
    )


def _tradeoff_cell(parts: dict[str, Row]) -> str:
    """The verdict over the two parts, and each part's effect [CI]."""
    if set(parts) != {"rel_err", "spearman"}:
        return "not measured"
    reading = combined_verdict([str(t["verdict"]) for t in parts.values()])
    effects = ", ".join(f"{part} {interval(t['effect'], t['ci_low'], t['ci_high'], 2)}" for part, t in parts.items())
    return f"**{reading}** · {effects}"


def _ill_posed(real: list[Row]) -> str:
    """In words, where the data cannot support per-layer statements: pools with too few distinct inputs (left out
    of every claim, `claims.well_posed`), and layers where some neighbourhoods cannot identify the map."""
    small = sorted(f"`{model}` layer {layer}" for model, layer in _ill_posed_pools(real))
    dropped = sorted({f"`{g['model']}` layer {g['layer']}" for g in real if g["n_value_kept"] < g["n"]})
    lines = []
    if small:
        lines.append(
            f"**Not well posed**: fewer than 10·k distinct inputs in {len(small)} (model, layer) pools "
            f"({', '.join(small[:4])}{', …' if len(small) > 4 else ''}): they rest on repeated tokens, so "
            "they are left out of every claim."
        )
    if dropped:
        lines.append(
            f"Anchors whose value is not identified (left out) in {len(dropped)} (model, layer) pairs: the "
            "verdicts there rest on the remaining anchors only (Anchors kept, below)."
        )
    return "".join(f"\n{line}\n" for line in lines)


def _ill_posed_pools(geometry: list[Row]) -> set[tuple[str, int]]:
    """(model, layer) of the real pools that are not well posed (`claims.well_posed`)."""
    return {
        (g["model"], g["layer"])
        for g in geometry
        if g["sample"] == "real" and g["n_distinct"] is not None and not well_posed(g["n_distinct"], g["k"])
    }


def _init_vs_final(claims: list[ClaimSummary]) -> str:
    """Is the structure there at random initialisation, or does training make it? Per claim and subject."""
    at = {(c.subject, c.claim): c for c in claims}
    bases = sorted({c.subject.rsplit("@", 1)[0] for c in claims})
    rows = []
    for claim in CLAIMS:
        trained = [at.get((f"{b}@final", claim.name)) for b in bases]
        cells = [_trained_vs_init(t, at.get((f"{b}@init", claim.name))) for b, t in zip(bases, trained, strict=True)]
        if any(cell != "–" for cell in cells):
            rows.append([f"`{claim.name}`", *cells])
    return markdown_table(["claim"] + [f"{b}: trained / init" for b in bases], rows)


def _trained_vs_init(final: ClaimSummary | None, init: ClaimSummary | None) -> str:
    if final is None and init is None:
        return "–"
    return f"{final.verdict if final else '–'} / {init.verdict if init else '–'}"


# ------------------------------------------------------------------------------------- locality sweep
LOCALITY_COLUMNS = (
    "k",
    "subject",
    "fn",
    "claim",
    "null",
    "scope",
    "n_layers",
    "effect",
    "ci_low",
    "ci_high",
    "verdict",
)


def read_locality_sweep(path: Path) -> list[Row]:
    """The claim tests of the locality sweep (`presets/locality.yaml`: the study at several `analysis.k`), one
    CSV row per stratified test with `LOCALITY_COLUMNS`; none where the file is absent."""
    from pyarrow import csv

    if not path.is_file():
        return []
    table = csv.read_csv(path)
    missing = [c for c in LOCALITY_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)}; write it with the query in presets/locality.yaml")
    return [r for r in table.select(list(LOCALITY_COLUMNS)).to_pylist() if r["scope"] == "stratified"]


def _locality_sweep(rows: Sequence[Row]) -> str:
    """Each claim's verdict on the trained models at every neighbourhood size of the sweep, and which move."""
    by_k: dict[int, list[ClaimSummary]] = {}
    for k in sorted({int(r["k"]) for r in rows}):
        by_k[k] = [c for c in summarise([r for r in rows if r["k"] == k]) if c.subject.endswith("@final")]
    if len(by_k) < 2:
        return ""
    at = {(k, c.subject, c.claim): c.verdict for k, summaries in by_k.items() for c in summaries}
    subjects = sorted({subject for _, subject, _ in at})
    table, flips, shifts = [], [], 0
    for claim in CLAIMS:
        cells = [" / ".join(at.get((k, s, claim.name), "–") for k in by_k) for s in subjects]
        if any(cell.replace("–", "").strip(" /") for cell in cells):
            table.append([f"{claim.label} (`{claim.name}`)", *cells])
        for s in subjects:
            readings = {k: at[k, s, claim.name] for k in by_k if (k, s, claim.name) in at}
            if len(set(readings.values())) < 2:
                continue
            held = [str(k) for k, reading in readings.items() if reading == SUPPORTED]
            if held:  # what the headline counts changes with k
                others = ", ".join(str(k) for k, reading in readings.items() if reading != SUPPORTED)
                flips.append(
                    f"{claim.label} ({s.removesuffix('@final')}: supported at k = {', '.join(held)}, not "
                    f"at k = {others})"
                )
            else:
                shifts += 1
    ks = ", ".join(f"k = {k}" for k in by_k)
    verdicts = (
        f"Whether a claim is supported changes with k in {len(flips)} cell{'' if len(flips) == 1 else 's'}: "
        f"{'; '.join(flips)}."
        if flips
        else "Whether a claim is supported changes with k in no cell."
    )
    if shifts:
        verdicts += f" In {shifts} more, the verdict changes with k but is supported at no k."
    note = (
        f"The trained models' verdicts at {ks} (`presets/locality.yaml`, its committed tables in "
        f"`docs/locality/`), each cell in that order. {verdicts} Larger neighbourhoods are less local: a map "
        "fitted on them is closer to one fitted for the whole layer.\n"
    )
    header = ["claim", *(f"{s.removesuffix('@final')}: {' / '.join(str(k) for k in by_k)}" for s in subjects)]
    return "### Locality: the claims at other neighbourhood sizes\n\n" + markdown_table(header, table) + "\n" + note
