"""Study A's part of the report (`pipeline.results.report`): the paper's claims in the summary (in words, the
heat map, the numbers) and its one-sentence finding, and the section with the models, init vs trained and the
functional claim's figure."""

from __future__ import annotations

from pipeline.results.common import Figures, Row, Tables, interval, markdown_table, median, num
from pipeline.results.study_a import figures as fig
from pipeline.results.study_a.claims import (
    ACROSS,
    CLAIMS,
    SUPPORTED,
    Claim,
    ClaimSummary,
    combined_verdict,
    in_summary,
    subject_of,
)
from pipeline.study_a.classes import FIT_CLASSES

NULL_TEXT = {"shuffled": "shuffled pairs", "gaussian": "Gaussian pool", "random": "random patch",
             "other": "other anchor's residual", "zero": "0"}  # fmt: skip
CLAIMS_BY_NAME = {claim.name: claim for claim in CLAIMS}


def claims_summary(claims: list[ClaimSummary], fitted: bool, tests: list[Row], figures: Figures) -> str:
    """The paper's claims for a newcomer: a sentence per claim with its verdict per architecture (and external
    model), the claims × layers heat map under them, then the table with the test that decides each verdict."""
    trained = [c for c in claims if not c.subject.endswith("@init")]
    if not trained:
        why = ("no claim could be tested (no null samples, or fewer than 10 complete anchors per layer)" if fitted
               else "Study A was not run (no fits)")  # fmt: skip
        return f"**Study A (the paper's claims)**: not measured: {why}, so the data says nothing about the claims.\n"
    sentences = "\n".join(_claim_sentence(claim, [c for c in trained if c.claim == claim.name]) for claim in CLAIMS
                          if any(c.claim == claim.name for c in trained))  # fmt: skip
    heat_map = figures.show(fig.claims_by_layer(tests), "study_a_claims_by_layer",
                            "Where each claim holds, layer by layer (rows: the claims above; a panel per model, "
                            "`@final` after training, `@init` at initialisation). Blue: supported, red: not "
                            "supported, grey: the data cannot decide; pale: the fit classes disagree, leaning that "
                            "way.")  # fmt: skip
    return f"{sentences}\n\n{heat_map}\n{_claims_table(trained)}"


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
    return f"mixed: {supporting} of {len(c.verdicts)} classes support it"


def finding(claims: list[ClaimSummary]) -> str | None:
    """Study A in one sentence: how many of the paper's claims hold on every trained architecture, on some, on
    none (README's findings)."""
    trained = [c for c in claims if c.subject.endswith("@final")]
    if not trained:
        return None
    subjects = sorted({c.subject.removesuffix("@final") for c in trained})
    supported = {claim.name: sum(c.verdict == SUPPORTED for c in trained if c.claim == claim.name) for claim in CLAIMS
                 if any(c.claim == claim.name for c in trained)}  # fmt: skip
    every = [CLAIMS_BY_NAME[n].label for n, k in supported.items() if k == len(subjects)]
    none = [n for n, k in supported.items() if k == 0]
    some = len(supported) - len(every) - len(none)
    partly = sum(any(v == SUPPORTED for c in trained if c.claim == n for v in c.verdicts.values()) for n in none)

    def named(labels: list[str]) -> str:
        return f"{len(labels)} ({', '.join(f'“{label}”' for label in labels)})" if labels else "0"

    by_some_classes = f", {partly} of them by some of the fit classes" if partly else ""
    return (f"Study A ({', '.join(subjects)}), the paper's {len(supported)} claims: {named(every)} supported on every "
            f"architecture, {some} on some, {named([CLAIMS_BY_NAME[n].label for n in none])} on none"
            f"{by_some_classes}.")  # fmt: skip


def _claims_table(trained: list[ClaimSummary]) -> str:
    """One row per claim, one column per trained architecture (and external model): the verdict, and the
    test that decides it (statistic vs null, effect with its CI)."""
    subjects = sorted({c.subject for c in trained})
    at = {(c.subject, c.claim): c for c in trained}
    layers = {s: max(n for c in trained if c.subject == s for n in c.layers.values()) for s in subjects}
    rows = []
    for claim in CLAIMS:
        if any((s, claim.name) in at for s in subjects):
            cells = [_claim_cell(at.get((s, claim.name)), layers[s]) for s in subjects]
            rows.append([f"{claim.label} (`{claim.name}`; paper: {claim.seed_value})", *cells])
    head = ("The numbers: each claim against its null over layers and seeds (stratified, never pooled), 95% "
            "interval from a two-stage bootstrap (seeds, then anchors). A cell gives the verdict over the local fit "
            "classes (each class must pass every null; `global_linear` and the layer-wide fits are baselines), then "
            "the test that decides it: statistic vs null → effect [CI] (class, null; the layers, seeds and anchors "
            "it rests on). *Supported*: above 0 beyond chance (Holm over the cell's classes and nulls) and at least "
            "the claim's margin; *not supported*: above 0 but the interval below the margin; *contradicted*: below "
            "0 beyond chance; *inconclusive*: otherwise. A null of *0* means the statistic is itself an effect "
            "(tested against zero). `init` and the per-class tests are in Study A below.\n")  # fmt: skip
    return f"{head}\n{markdown_table(['claim'] + [s.removesuffix('@final') for s in subjects], rows)}"


def _claim_cell(c: ClaimSummary | None, layers: int) -> str:
    """The verdict, the deciding test and what it rests on; a class whose verdict rests on fewer than half
    of the subject's `layers` is named (the others' anchors were not identified there)."""
    if c is None:
        return "not measured"
    t = c.weakest
    effect = interval(t["effect"], t["ci_low"], t["ci_high"], 2)
    null = NULL_TEXT.get(t["null"], t["null"])
    versus = f"{num(t['statistic'], 2)} vs {num(t['null_statistic'], 2)}"
    rests = f"{t['n_layers']} layers, {t['n_models']} seeds, {t['n']} anchors"
    few = [f"{fn} on {n} of {layers} layers" for fn, n in c.layers.items() if 2 * n < layers]
    warning = f" · **{'; '.join(few)}**" if few else ""
    return f"**{c.verdict}** · {versus} → {effect} ({t['fn']}, {null}; {rests}){warning}"


def section(tables: Tables, claims: list[ClaimSummary], figures: Figures) -> str:
    out = ["## Study A: layer-update geometry\n"]
    if not tables["geometry"]:
        return out[0] + "\nStudy A was not run: there are no fits.\n"
    out.append(
        "Per model and layer a tokenwise map T is fitted on each anchor's nearest neighbours; Δ_full = h_{l+1} − h_l "
        "splits into Δ_tok = T(h_l) − h_l and a residual r (SPEC §4.2). Each claim is tested against nulls (SPEC "
        "§4.5): the geometric ones against the same fits on shuffled pairs and on a Gaussian pool, the functional "
        "ones against patches of norm ‖r‖ in a random direction or along another anchor's residual. Effect = "
        "statistic − null, stratified over layers and seeds, its interval from a two-stage bootstrap (seeds, then "
        "anchors). **Supported**: above 0 beyond chance (Holm over the tests a summary cell combines) and effect ≥ "
        "the claim's margin; **not supported**: above 0 but the interval below the margin; **contradicted**: below "
        "0 beyond chance; **inconclusive**: otherwise.\n"
    )  # fmt: skip
    out.append(_models_table(tables["geometry_pooled"], tables["geometry"]))
    out.append(_kept_table(tables["geometry"]))
    out.append(_expressivity(tables["expressivity"], tables["claim_tests"]))
    checkpoints = [c for c in claims if c.subject.endswith(("@init", "@final"))]  # an external model has neither
    if checkpoints:
        out.append("### Init vs trained\n")
        out.append(_init_vs_final(checkpoints))
    out.append(figures.show(fig.spearman_vs_null(tables["claim_tests"]), "study_a_spearman_vs_null",
                            "Spearman(rel_err, kl) minus the same with a random patch of equal norm, per layer, "
                            "with 95% bootstrap CI (dotted: the claim's margin)."))  # fmt: skip
    out.append("Every test per class, null and layer: `lmgeo query \"SELECT * FROM claim_tests\"` "
               "(`scope = 'stratified'` for the summary's rows).\n")  # fmt: skip
    return "\n".join(part for part in out if part)


def _models_table(pooled: list[Row], geometry: list[Row]) -> str:
    """One row per distinct model (each distinct initialisation once): how well posed its fits are, what
    was excluded as non-finite, and per class rel_err with `cos_full_tok` beside the bound √(1 − rel_err²)
    that rel_err alone implies."""
    real = [g for g in geometry if g["sample"] == "real"]
    fns = list(dict.fromkeys(p["fn"] for p in pooled))
    at = {(p["model"], p["fn"]): p for p in pooled}
    rows = []
    for model in sorted({p["model"] for p in pooled}):
        layers = [g for g in real if g["model"] == model]
        classes = [at[(model, fn)] for fn in fns if (model, fn) in at]
        distinct = [g["n_distinct"] for g in layers if g["n_distinct"] is not None]
        row = [f"`{model}`", classes[0]["n_layers"], min(distinct) if distinct else None, layers[0]["k"],
               f"{min(g['n_value_kept'] / g['n'] for g in layers if in_summary(g['fn'])):.0%}",
               (f"{max(c['n_nonfinite'] or 0 for c in classes)} pool tokens, "
                f"{max(c['n_nonfinite_values'] for c in classes)} anchors")]  # fmt: skip
        for fn in fns:
            p = at.get((model, fn))
            bound = median([g["median_cos_bound"] for g in layers if g["fn"] == fn])
            fit = f"{num(p['layer_median_rel_err'], 2)} · {num(p['layer_median_cos_full_tok'], 2)}" if p else None
            row.append(f"{fit} ≥ {num(bound, 2)}" if fit else "–")
        rows.append(row)
    note = ("Per distinct model (`@init`: each distinct initialisation once). *distinct inputs*: fewest distinct h_l "
            "in a layer's pool (SPEC asks ≥ 10·k); *kept*: smallest share of anchors in a (layer, local class) whose "
            "value at the anchor is identified (the others are left out; per layer below); *excluded non-finite*: "
            "pool tokens and anchors left out of every statistic. Per class: median over layers of rel_err · "
            "cos_full_tok ≥ √(1 − rel_err²), both over the same anchors; "
            "the bound follows from rel_err alone, so cos_full_tok near 1 is no evidence beyond a small residual. "
            "Per layer: `lmgeo query \"SELECT * FROM geometry WHERE sample = 'real'\"`.\n")  # fmt: skip
    header = ["model", "layers", "distinct inputs", "k", "kept", "excluded non-finite"] + [
        f"{fn}: rel_err · cos ≥ bound" for fn in fns]  # fmt: skip
    return "### Models\n\n" + markdown_table(header, rows) + "\n" + note + _ill_posed(real)


def _kept_table(geometry: list[Row]) -> str:
    """Per subject (its seeds pooled) and local class, the share of anchors each layer keeps: with the value
    at the anchor identified (what rel_err, the angle and the KL claims use), and with the local operator
    identified (what proj_* use)."""
    real = [g for g in geometry if g["sample"] == "real" and in_summary(g["fn"])]
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
    rows = [[f"`{subject}`", *(cell(subject, fn) for fn in fns),
             "·".join(num(locality.get((subject, layer)), 2) for layer in layers)] for subject in subjects]  # fmt: skip
    note = (f"Anchors kept, % per layer {layers[0]}–{layers[-1]} (seeds pooled): value identified / operator "
            "identified (`identity` has no operator). A claim rests only on the kept anchors. *locality*: per layer, "
            "the median over anchors and seeds of the k-th neighbour's distance over the median distance of random "
            "pairs of the layer's pool (1: a neighbourhood as wide as the pool's typical spread; near 0: local).\n")
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
    Spearman(rel_err, kl) with their seed-level intervals; a last row with the trade-off's verdict (both must
    fall with capacity) and each part's effect."""
    if not classes:
        return ""
    subjects = sorted({c["subject"] for c in classes})
    at = {(c["subject"], c["fn"]): c for c in classes}
    fns = list(dict.fromkeys(c["fn"] for c in sorted(classes, key=lambda c: (c["parameters"], c["fn"]))))
    rows = []
    for fn in fns:
        parameters = " / ".join(dict.fromkeys(str(at[(s, fn)]["parameters"]) for s in subjects if (s, fn) in at))
        cells = [_class_cell(at.get((s, fn))) for s in subjects]
        rows.append([f"`{fn}`", parameters, *cells])
    verdicts = {(t["subject"], t["null"]): t for t in tests if t["fn"] == ACROSS and t["scope"] == "stratified"}
    rows.append(["**trade-off**", "", *(_tradeoff_cell([verdicts.get((s, part)) for part in ("rel_err", "spearman")])
                                        for s in subjects)])  # fmt: skip
    note = ("More expressive classes shrink the residual (rel_err falls with capacity) but weaken its correlation "
            "with KL (Spearman falls with capacity): the seed's claim, tested per layer on the anchors every class "
            "keeps. Classes in order of capacity (free parameters of one map at the model's width); a cell: median "
            "rel_err · Spearman(rel_err, kl), the mean over layers (never pooled) and seeds, 95% interval from the "
            "two-stage bootstrap (seeds, then anchors). Each part's effect is −Spearman(capacity, value) over the "
            "classes (+1: falls strictly), tested against the bootstrap and a permuted capacity order (p the larger "
            "of the two, Holm over the two parts); the trade-off is supported when both parts are.\n")  # fmt: skip
    header = ["class", "parameters", *(f"`{s}`" for s in subjects)]
    return "### Expressivity trade-off\n\n" + markdown_table(header, rows) + "\n" + note


def _class_cell(c: Row | None) -> str:
    if c is None:
        return "–"
    return (f"{interval(c['rel_err'], c['rel_err_low'], c['rel_err_high'], 2)} · "
            f"{interval(c['spearman'], c['spearman_low'], c['spearman_high'], 2)}")  # fmt: skip


def _tradeoff_cell(parts: list[Row | None]) -> str:
    """The verdict over the two parts, and each part's effect [CI]."""
    if not all(parts):
        return "not measured"
    reading = combined_verdict([str(t["verdict"]) for t in parts if t])
    effects = ", ".join(f"{t['null']} falls {interval(t['effect'], t['ci_low'], t['ci_high'], 2)}" for t in parts if t)
    return f"**{reading}** · {effects}"


def _ill_posed(real: list[Row]) -> str:
    """In words, where the data cannot support per-layer statements: pools with fewer than 10·k distinct
    inputs, and layers where some neighbourhoods cannot identify the map."""
    small = sorted({f"`{g['model']}` layer {g['layer']}" for g in real
                    if g["n_distinct"] is not None and g["n_distinct"] < 10 * g["k"]})  # fmt: skip
    dropped = sorted({f"`{g['model']}` layer {g['layer']}" for g in real if g["n_value_kept"] < g["n"]})
    lines = []
    if small:
        lines.append(f"**Not well posed**: fewer than 10·k distinct inputs in {len(small)} (model, layer) pools "
                     f"({', '.join(small[:4])}{', …' if len(small) > 4 else ''}); the claims there rest on repeated "
                     "tokens and should not be read as evidence either way.")  # fmt: skip
    if dropped:
        lines.append(f"Anchors whose value is not identified (left out) in {len(dropped)} (model, layer) pairs: the "
                     "verdicts there rest on the remaining anchors only (Anchors kept, below).")  # fmt: skip
    return "".join(f"\n{line}\n" for line in lines)


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
