"""Study B's part of the report (`lmgeo.results.report`): the comparison with `muon` in the summary (in
words, its figures, the table) and its one-sentence finding, the
section (protocol, power, tuning, step geometry, claims, the matched-budget ablation, figures) and the
per-run appendix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from lmgeo.results.common import Figures, Row, Tables, finite, interval, markdown_table, median, num
from lmgeo.results.stats import detectable_difference, seeds_needed
from lmgeo.results.study_b import figures as fig
from lmgeo.results.study_b.record import SweepRecord
from lmgeo.results.study_b.tables import POWER, REGIME_MARGIN, RESOLVE_NATS, SIGNIFICANCE
from lmgeo.study_b.baseline import baseline
from lmgeo.study_b.recipes import RECIPES

# A record of knobs tuned alone (`lmgeo tune --recipe … --out …`) beside the main one: its path and content.
KnobRecord = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class SweepTables:
    """The matched-budget sweep the report states: its rows of `recipes` (matched) and `envelope`, the
    recipes' own-step rows on the same seeds and protocol, and where they come from (None: this study)."""

    matched: list[Row]
    envelope: list[Row]
    own_step: list[Row]
    bigram: float | None  # the smoothed bigram's test loss on the sweep's test windows
    source: str | None = None
    # (arch, recipe) → (the cited record's head step, this study's) where the two differ: the record's rows of
    # that recipe are of another step than this study's runs (a default_step adopted after the record).
    other_steps: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)


def sweep_source(tables: Tables, record: SweepRecord | None) -> SweepTables:
    """The study's own sweep where it ran one; else the committed record's (`docs/sweep/`), cited; else none."""
    matched = runs_of_kind(tables["recipes"], True)
    if matched or record is None:
        return SweepTables(
            matched, tables["envelope"], runs_of_kind(tables["recipes"]), _bigram(tables.get("baselines", []))
        )
    own_step = runs_of_kind(record.tables["recipes"])
    return SweepTables(
        runs_of_kind(record.tables["recipes"], True),
        record.tables["envelope"],
        own_step,
        _bigram(record.tables.get("baselines", [])),
        record.describe(),
        _other_steps(own_step, runs_of_kind(tables["recipes"])),
    )


def _other_steps(recorded: list[Row], here: list[Row]) -> dict[tuple[str, str], tuple[str, str]]:
    ran = {(r["arch"], r["recipe"]): r["head_step"] for r in here}
    return {
        key: (r["head_step"], ran[key])
        for r in recorded
        if (key := (r["arch"], r["recipe"])) in ran and r["head_step"] != ran[key]
    }


def _other_steps_statement(sweep: SweepTables) -> str:
    """The recipes the cited record trained at another head step than this study, in one bold sentence."""
    if not sweep.other_steps:
        return ""
    listed = "; ".join(
        f"`{recipe}` ({arch}) at {then} (here: {now})" for (arch, recipe), (then, now) in sweep.other_steps.items()
    )
    return (
        f"**Not this study's head step**: the record trained {listed}, so its rows of "
        f"{'that recipe' if len(sweep.other_steps) == 1 else 'those recipes'} (own step, every budget, "
        "envelope) are of that step, not of this study's runs."
    )


def _bigram(baselines: Sequence[Row]) -> float | None:
    return next((b["test_loss"] for b in baselines if b["model"] == "bigram"), None)


def _pooled(sds: Sequence[float | None]) -> float | None:
    """The root mean square of the measured standard deviations."""
    found = finite(sds)
    return float(np.sqrt(np.mean(np.square(found)))) if found.size else None


def _by_arch_recipe(rows: Sequence[Row]) -> dict[tuple[str, str], list[Row]]:
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r["arch"] and r["recipe"]:
            groups.setdefault((r["arch"], r["recipe"]), []).append(r)
    return dict(sorted(groups.items(), key=lambda g: (g[0][0], RECIPES.order(g[0][1]))))


# ----------------------------------------------------------------------------------------- summary
def summary(tables: Tables, figures: Figures, sweep: SweepTables) -> str:
    """The comparison with `muon` for a newcomer: in words (at the recipes' own step sizes, then at equal
    worst-case nats per step), the forest plot beside the budget sweep, then the table."""
    reference = baseline().name
    runs, recipes = runs_of_kind(tables["runs"]), runs_of_kind(tables["recipes"])
    rows = [r for r in recipes if r["recipe"] != reference]
    if not rows:
        return "**Study B (head optimizers)**: not measured, Study B was not run (no training logs).\n"
    out = [
        f"At each recipe's own tuned step size, final test loss against `{reference}` on the same seeds:\n",
        plain_comparison(rows),
        regime_statement(recipes, tables.get("baselines", [])),
    ]
    if sweep.matched:
        cited = f" From {sweep.source}. {_other_steps_statement(sweep)}".rstrip() if sweep.source else ""
        out.append(
            "**At equal worst-case nats per step** (the matched-budget sweep: every head step rescaled to "
            f"the same budget, against `{reference}` at that budget).{cited}\n\n"
            f"{sweep_summary(sweep.matched, sweep.envelope)}"
        )
    out.append(
        figures.beside(
            [
                (
                    fig.vs_muon(recipes, runs, _resolved_reading),
                    "study_b_vs_muon",
                    f"Left: each recipe's final test loss minus `{reference}`'s on the same seed (dots: seeds; "
                    "bar: mean and 95% t-interval, not adjusted). Filled: the difference is resolved — the paired "
                    f"t-test's p, Holm-adjusted over the arch's recipes, is below {SIGNIFICANCE:g}, "
                    "the table's reading —, "
                    "left of 0 beating "
                    f"`{reference}`, right of 0 losing to it; hollow: not resolved, even where the unadjusted interval "
                    "excludes 0.",
                ),
                (
                    fig.loss_vs_budget(sweep.matched, sweep.own_step, sweep.bigram),
                    "study_b_loss_vs_budget",
                    "Right: the matched-budget sweep, final test loss against the head budget (log axis; mean and 95% "
                    "t-interval over seeds; square: the recipe at its own tuned step, same seeds and horizon; "
                    "dashed: the "
                    "smoothed bigram, a triangle on the top edge: a mean above the axis, with its value); lines that "
                    "cross mean the verdict depends on the budget.",
                ),
            ]
        )
    )
    out.append(comparison_table(recipes))
    return "\n".join(part for part in out if part)


def regime_statement(recipes: list[Row], baselines: list[Row]) -> str:
    """Whether the models are trained: each recipe's test loss against the n-gram baselines on the same test
    windows (a recipe not REGIME_MARGIN below the bigram is named)."""
    by_model = {b["model"]: b for b in baselines}
    if "bigram" not in by_model:
        return ""
    bigram, unigram = by_model["bigram"]["test_loss"], by_model.get("unigram", {}).get("test_loss")
    gaps = {
        f"`{r['recipe']}` ({r['arch']})": bigram - r["test_loss_mean"]
        for r in recipes
        if r["test_loss_mean"] is not None
    }
    if not gaps:
        return ""
    short = [name for name, gap in gaps.items() if gap < REGIME_MARGIN]
    verdict = (
        f"every recipe is {num(min(gaps.values()), 2)}–{num(max(gaps.values()), 2)} nats below the bigram"
        if not short
        else f"not {REGIME_MARGIN:g} nats below the bigram: {', '.join(short)} (a toy regime "
        "for those: the comparison says little about trained models)"
    )
    return (
        f"- Trained regime: on the same test windows a unigram scores {num(unigram, 4)} nats and a smoothed "
        f"bigram {num(bigram, 4)} ({by_model['bigram']['smoothing']}); at their tuned steps {verdict}.\n"
    )


def finding(recipes: list[Row]) -> str | None:
    """Study B in one sentence per architecture compared: how many recipes are resolved below, above `muon`,
    and which the seeds cannot tell, each with its effect (the paired difference in test loss, README's
    findings)."""
    reference = baseline().name
    sentences = []
    for arch in sorted({r["arch"] for r in recipes if r["recipe"] != reference and r["diff_vs_muon"] is not None}):
        rows = [r for r in recipes if r["arch"] == arch and r["recipe"] != reference and r["diff_vs_muon"] is not None]
        by_reading: dict[str, list[Row]] = {}
        for r in rows:
            by_reading.setdefault(_reading(r) if _reading(r).endswith("than muon") else "unresolved", []).append(r)
        lower, higher, unresolved = (
            by_reading.get(k, []) for k in ("lower than muon", "higher than muon", "unresolved")
        )
        sentences.append(
            f"Study B ({arch}): at their own tuned step sizes, {_count(lower)} of {len(rows)} head recipes reach a "
            f"lower test loss than `{reference}`, {_count(higher)} a higher one, and {_count(unresolved)} "
            f"cannot be told apart from it with these seeds (Δ: test loss − `{reference}`'s on the same seeds, "
            "nats, 95% CI)."
        )
    return " ".join(sentences) or None


def meaning(recipes: list[Row]) -> str | None:
    """Study B in plain words, per architecture compared: do the head steps built for the Hilbert geometry (the
    recipes with a trust region in nats) train a better model than the reference's head, or a worse one?"""
    found = meanings(recipes)
    return " ".join(f"Study B in plain words ({arch}): {text}." for arch, text in found) or None


def meanings(recipes: list[Row]) -> list[tuple[str, str]]:
    """`meaning`'s finding per architecture compared: (arch, the clause, lower case, no full stop)."""
    reference = baseline().name
    sentences = []
    for arch in sorted({r["arch"] for r in recipes if r["diff_vs_muon"] is not None}):
        hilbert = [
            r
            for r in recipes
            if r["arch"] == arch and r["diff_vs_muon"] is not None and RECIPES[r["recipe"]].trust_region
        ]
        if not hilbert:
            continue
        better, worse = ([r for r in hilbert if _reading(r) == f"{side} than muon"] for side in ("lower", "higher"))
        parts = [
            f"{_names(better)} {_trains(better)} a better model than `{reference}`'s head does"
            if better
            else f"stepping the LM head in the Hilbert geometry ({_names(hilbert)}) is not shown to train a better "
            f"model than `{reference}`'s head with these seeds"
        ]
        if worse:
            parts.append(f"{_names(worse)} {_trains(worse)} a worse one")
        sentences.append((arch, ", and ".join(parts)))
    return sentences


def _names(rows: list[Row]) -> str:
    return ", ".join(f"`{r['recipe']}`" for r in rows)


def _trains(rows: list[Row]) -> str:
    return "trains" if len(rows) == 1 else "train"


def _count(rows: list[Row]) -> str:
    """How many recipes, each named with its Δ to the reference."""
    named = [f"`{r['recipe']}` Δ {interval(r['diff_vs_muon'], r['diff_ci_low'], r['diff_ci_high'], 2)}" for r in rows]
    return f"{len(rows)} ({', '.join(named)})" if rows else "none"


def comparison_table(recipes: list[Row]) -> str:
    """Per arch and recipe: the final test loss, and the paired comparison with `muon` in numbers and in words."""
    reference = baseline().name
    rows = [r for r in recipes if r["recipe"] != reference]
    head = (
        f"The numbers, on the held-out test split: final test loss over seeds, and the difference to "
        f"`{reference}` on the same seeds (paired t-interval, not adjusted; p of the paired t-test, Holm-adjusted "
        f"over the arch's recipes, decides the reading). *Detectable Δ*: the difference these seeds detect with "
        f"power {POWER:g}.\n"
    )
    base = {r["arch"]: r["test_loss_mean"] for r in recipes if r["recipe"] == reference}
    body = [
        [
            r["arch"],
            f"`{r['recipe']}`",
            r["n_seeds"],
            interval(r["test_loss_mean"], r["test_loss_ci_low"], r["test_loss_ci_high"], 4),
            num(base.get(r["arch"]), 4),
            "–" if r["diff_vs_muon"] is None else interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]),
            num(r["p_vs_muon_holm"], 2),
            num(r["detectable_diff"], 2),
            _reading(r),
        ]
        for r in rows
    ]
    header = [
        "arch",
        "recipe",
        "seeds",
        "test loss [95% CI]",
        f"{reference}'s",
        f"Δ vs {reference} [95% CI]",
        "Holm p",
        "detectable Δ",
        "reading",
    ]
    return f"{head}\n{markdown_table(header, body)}"


def plain_comparison(rows: list[Row]) -> str:
    """The table in words: which recipes are resolved below or above muon, and which the seeds cannot tell."""
    readings: dict[str, list[str]] = {}
    for r in rows:
        reading = _reading(r)
        key = reading if reading in ("lower than muon", "higher than muon") else "unresolved"
        key = "not compared" if r["diff_vs_muon"] is None else key
        readings.setdefault(key, []).append(f"`{r['recipe']}` ({r['arch']})")
    named = len({r["arch"] for r in rows}) > 1  # several archs: each figure says whose it is
    detectable = [
        f"{num(p.detectable, 2)} nats" + (f" on {arch}" if named else "")
        for arch, p in power_by_arch(rows).items()
        if math.isfinite(p.detectable)
    ]
    lines = [
        f"- Lower test loss than `muon`: {', '.join(readings.get('lower than muon', [])) or 'no recipe'}.",
        f"- Higher than `muon`: {', '.join(readings.get('higher than muon', [])) or 'no recipe'}.",
    ]
    if "not compared" in readings:
        lines.append(
            f"- Not compared (no `muon` run on the same seeds, or every run diverged): "
            f"{', '.join(readings['not compared'])}."
        )
    if "unresolved" in readings:
        limit = (
            f" (differences below about {', '.join(detectable)} are within seed noise at power {POWER:g}, "
            "as the protocol states)"
            if detectable
            else ""
        )
        lines.append(f"- Not resolved from `muon` with these seeds{limit}: {', '.join(readings['unresolved'])}.")
    return "\n".join(lines) + "\n"


def _resolved_reading(r: Row) -> bool:
    """The table's reading resolves the difference (Holm-adjusted paired test below SIGNIFICANCE)."""
    return _reading(r) in ("lower than muon", "higher than muon")


def _reading(r: Row) -> str:
    """The comparison in words, saying when the seeds cannot resolve it."""
    p, diff = r["p_vs_muon_holm"], r["diff_vs_muon"]
    if diff is None:
        all_diverged = r["n_runs"] and r["n_diverged"] == r["n_runs"]
        return "every run diverged" if all_diverged else "not compared (no paired seeds)"
    if p is None:
        return f"not tested: {r['n_paired']} paired seeds, a test needs 3"
    if p < SIGNIFICANCE:
        return "lower than muon" if diff < 0 else "higher than muon"
    return f"no difference resolved (these seeds detect ≥ {num(r['detectable_diff'], 2)} nats)"


# ----------------------------------------------------------------------------------------- section
def runs_of_kind(rows: list[Row], matched: bool = False) -> list[Row]:
    """The rows of the default runs (or of the matched-budget runs) of a `runs` or `recipes` table."""
    return [r for r in rows if bool(r["matched"]) == matched]


def section(
    tables: Tables,
    figures: Figures,
    tuning: dict[str, Any] | None,
    sweep: SweepTables,
    knob_records: Sequence[KnobRecord] = (),
) -> str:
    runs, curves, recipes = runs_of_kind(tables["runs"]), tables["curves"], runs_of_kind(tables["recipes"])
    out = ["## Study B: LM-head update geometry\n"]
    if not runs:
        return out[0] + "\nStudy B was not run: there are no training logs.\n"
    out.append(_protocol(runs, recipes, tuning, knob_records))
    out.append(
        figures.show(
            fig.val_loss(curves, runs),
            "study_b_val_loss",
            "Validation loss over training per recipe (mean over seeds): where the curves separate, "
            "and whether they still fall at the last step.",
        )
    )
    out.append("### Head step geometry\n")
    out.append(_geometry_table(runs))
    out.append(_study_b_claims(tables["claims"]))
    out.append(
        figures.show(
            fig.head_step(curves, runs),
            "study_b_head_step",
            "Head step per recipe (median over seeds): its size in Hilbert units (which recipes take "
            "the largest steps), the bound's tightness on exact-diameter steps (≤ 1, SPEC §3.1: a "
            "value near 1 means the bound is nearly attained), and how evenly the update's rows are "
            "spread (dotted: random unit rows; only `hilbert_equi` trades descent for spread, as "
            "much as its descent share c allows).",
        )
    )
    out.append(_matched_budget(sweep))
    return "\n".join(part for part in out if part)


def _matched_budget(sweep: SweepTables) -> str:
    """The matched-budget sweep: every recipe again at each budget, against `muon` at the same budget; how much
    each budget rescaled the recipe's own step and what it changed; each recipe at its best budget (the
    envelope)."""
    out = ["### Step size vs direction: the matched-budget sweep\n"]
    recipes, envelope = sweep.matched, sweep.envelope
    if not recipes:
        return out[0] + (
            "Not in this study (`train.matched_budget` is null) and no committed record of it "
            "(`docs/sweep/`): recipes differ in step size as well as direction.\n"
        )
    reference = baseline().name
    if sweep.source:
        out.append(
            f"This study does not run the sweep (`train.matched_budget` is null, for its time); its numbers "
            f"are the preset's: {sweep.source}. That run trains this study's default runs too, on the "
            "same seeds, so its own-step rows are this study's where the revision's code and head steps "
            f"agree. {_other_steps_statement(sweep) or 'Every recipe there ran the head step run here.'}\n"
        )
    out.append(
        _sweep_protocol(recipes) + " Every head step (decay included) is rescaled, up or down, so that "
        "diam(ΔW) = tau_t / r_t (tau on the head's schedule, r_t = max ‖h‖ over the batch): at each budget "
        "every recipe moves each token's log-probabilities by the same worst case, and only the direction "
        f"differs. Δ is against `{reference}` at the same budget on the same seeds (paired t-interval, not "
        "adjusted); \\* marks a difference resolved by the paired t-test after Holm over all the sweep's "
        "comparisons. *Rescale*: the median factor the budget applied to the recipe's own step (> 1: it "
        "enlarged it); *budget's effect*: the matched run's test loss minus the recipe's own-step run's, same "
        "seed. The sweep's runs are in table `runs` (`matched`), its rows in `recipes` (`head_budget_tau`), "
        "its envelope in `envelope`.\n"
    )
    out.append(_budget_matrix(recipes, reference))
    out.append(_envelope_table(envelope, reference))
    out.append("The sweep's figure (test loss against the budget) is in the summary.\n")
    return "\n".join(part for part in out if part)


def _sweep_protocol(recipes: list[Row]) -> str:
    """The sweep's horizon, seeds, budgets, correction and the trainings reported once, in one sentence."""
    budgets = sorted({r["head_budget_tau"] for r in recipes})
    seeds = sorted({r["n_seeds"] for r in recipes if r["n_seeds"]})
    steps = sorted({r["steps"] for r in recipes if r["steps"]})
    tokens = sorted({r["tokens"] for r in recipes if r["tokens"]})
    tested = sum(r["p_vs_muon"] is not None for r in recipes)
    merged = [
        f"`{name}` is `{spec.matched_as}`'s"
        for name, spec in ((r.name, r) for r in RECIPES)
        if spec.matched_as and spec.matched_as in {r["recipe"] for r in recipes}
    ]
    once = (
        f" Under a matched budget {', '.join(merged)} training step for step (SPEC §3.2): trained and reported once."
        if merged
        else ""
    )
    return (
        f"Every recipe trained again at each budget tau ∈ {{{', '.join(map(num, budgets))}}} nats, at the "
        f"comparison's horizon ({', '.join(map(str, steps))} steps, {', '.join(f'{t:,}' for t in tokens)} "
        f"tokens), on {'/'.join(map(str, seeds))} paired seeds; Holm over the sweep's {tested} comparisons "
        f"with `{baseline().name}`.{once}"
    )


def _budget_matrix(recipes: list[Row], reference: str) -> str:
    """Recipes × budgets: Δ vs muon at the same budget, and the rescale factor / the budget's effect."""
    budgets = sorted({r["head_budget_tau"] for r in recipes})
    cell = {(r["arch"], r["recipe"], r["head_budget_tau"]): r for r in recipes}
    delta_rows, scale_rows = [], []
    for arch, recipe in sorted({(r["arch"], r["recipe"]) for r in recipes}, key=lambda k: (k[0], RECIPES.order(k[1]))):
        here = [cell.get((arch, recipe, b)) for b in budgets]
        label = [arch, f"`{recipe}`"]
        if recipe != reference:
            delta_rows.append(label + [_delta_cell(r) if r else "–" for r in here])
        scale_rows.append(
            label + [f"×{num(r['median_step_scale'], 2)} / {num(r['budget_effect'])}" if r else "–" for r in here]
        )
    header = ["arch", "recipe", *(f"tau {num(b)}" for b in budgets)]
    return (
        f"Δ vs `{reference}` at the same budget (nats, [95% CI]; \\* resolved after Holm):\n\n"
        f"{markdown_table(header, delta_rows)}\n"
        f"Rescale of the recipe's own step / the budget's effect (nats):\n\n{markdown_table(header, scale_rows)}"
    )


def _delta_cell(r: Row) -> str:
    if r["diff_vs_muon"] is None:
        return "–"
    return interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]) + (" \\*" if _resolved(r) else "")


def _envelope_table(envelope: list[Row], reference: str) -> str:
    rows = [
        [
            r["arch"],
            f"`{r['recipe']}`",
            num(r["best_tau"]) + ("" if r["best_interior"] else " †"),
            interval(r["test_loss_mean"], r["test_loss_ci_low"], r["test_loss_ci_high"], 4),
            num(r["own_step_test_loss"], 4),
            "–" if r["diff_vs_muon"] is None else interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]),
            num(r["p_vs_muon_holm"], 2),
        ]
        for r in envelope
    ]
    header = [
        "arch",
        "recipe",
        "best budget",
        "test loss there [95% CI]",
        "own step",
        f"Δ vs {reference} at its best",
        "Holm p",
    ]
    return (
        "The envelope, each recipe at its best budget (chosen on the mean final val loss, read on test; † on the "
        "grid's edge: the best may lie beyond it), the fair overall comparison of directions:\n\n"
        f"{markdown_table(header, rows)}"
    )


def _resolved(r: Row) -> bool:
    """A difference the seeds resolve: the paired t-test's p, Holm-adjusted, below SIGNIFICANCE (untested
    below MIN_SEEDS_FOR_TEST seeds: never resolved)."""
    p = r["p_vs_muon_holm"]
    return r["diff_vs_muon"] is not None and p is not None and p < SIGNIFICANCE


def sweep_summary(recipes: list[Row], envelope: list[Row]) -> str:
    """The sweep in words: its protocol (horizon, seeds, correction), every difference resolved after Holm
    (naming its budget), and the envelope."""
    reference = baseline().name
    resolved = [
        f"at budget {num(r['head_budget_tau'])} ({r['arch']}), `{r['recipe']}` "
        f"{'beats' if r['diff_vs_muon'] < 0 else 'loses to'} `{reference}` by "
        f"{interval(abs(r['diff_vs_muon']), *_abs_interval(r))} nats"
        for r in recipes
        if r["recipe"] != reference and _resolved(r)
    ]
    none = f"no recipe is resolved from `{reference}` at any budget with these seeds."
    lines = [f"- {_sweep_protocol(recipes)}", "- Resolved: " + ("; ".join(resolved) + "." if resolved else none)]
    lines += [line for arch in sorted({r["arch"] for r in envelope}) if (line := _envelope_sentence(envelope, arch))]
    edge = [f"`{r['recipe']}` ({r['arch']}, {num(r['best_tau'])})" for r in envelope if not r["best_interior"]]
    if edge:
        lines.append("- Best budget on the grid's edge (the grid should be extended): " + ", ".join(edge) + ".")
    return "\n".join(lines) + "\n"


def _envelope_sentence(envelope: list[Row], arch: str) -> str | None:
    """The envelope in words: muon at its best budget, and each recipe resolved from it at its own."""
    reference = baseline().name
    rows = [r for r in envelope if r["arch"] == arch and r["recipe"] != reference and r["diff_vs_muon"] is not None]
    muon = next((r for r in envelope if r["arch"] == arch and r["recipe"] == reference), None)
    if not (muon and rows):
        return None
    resolved = [
        f"`{r['recipe']}` at budget {num(r['best_tau'])} {'lower' if r['diff_vs_muon'] < 0 else 'higher'} "
        f"by {interval(abs(r['diff_vs_muon']), *_abs_interval(r))}"
        for r in rows
        if _resolved(r)
    ]
    return (
        f"- Envelope ({arch}, each recipe at its best budget on val; `{reference}` at {num(muon['best_tau'])}, "
        f"test loss {num(muon['test_loss_mean'], 4)}): "
        + ("; ".join(resolved) if resolved else f"no recipe resolved from `{reference}`")
        + "."
    )


def _abs_interval(r: Row) -> tuple[float, float]:
    """The interval of |Δ| for a Δ of known sign."""
    low, high = r["diff_ci_low"], r["diff_ci_high"]
    return (low, high) if r["diff_vs_muon"] >= 0 else (-high, -low)


def _seeds_statement(runs: list[Row]) -> str:
    """Each arch's seeds, recipes grouped by the seeds they ran (the grid's, Study A's extra runs, or fewer
    where runs are missing)."""
    seeds: dict[str, dict[str, set[int]]] = {}
    for r in (r for r in runs if r["seed"] is not None):
        seeds.setdefault(r["arch"], {}).setdefault(r["recipe"], set()).add(r["seed"])
    described: dict[str, list[str]] = {}
    for arch, by_recipe in seeds.items():
        groups: dict[tuple[int, ...], list[str]] = {}
        for recipe, ran in by_recipe.items():
            groups.setdefault(tuple(sorted(ran)), []).append(f"`{recipe}`")
        text = ", ".join(
            f"seeds {', '.join(map(str, ran))} for " + (" and ".join(who) if len(who) <= 2 else f"{len(who)} recipes")
            for ran, who in sorted(groups.items(), key=lambda g: -len(g[1]))
        )
        described.setdefault(text, []).append(arch)
    return "; ".join(f"{', '.join(sorted(archs))}: {text}" for text, archs in described.items())


def _protocol(
    runs: list[Row], recipes: list[Row], tuning: dict[str, Any] | None, knob_records: Sequence[KnobRecord] = ()
) -> str:
    """What an optimizer researcher needs to trust the comparison (SPEC §3.2)."""
    lines = [
        "### Protocol\n",
        (
            "- **Splits.** Train, val and test are split by document. Tuning and the curves use val; recipes are "
            "compared on test, read once per run after its last step (no tuning run reads it)."
        ),
        (
            f"- **Seeds.** {_seeds_statement(runs)}. A seed fixes the initialisation and the batch order, so "
            "differences are paired on the seeds both runs have. Only the head's optimizer differs (`adamw`: every "
            "matrix); all recipes run the same steps and tokens."
        ),
        _power_statement(recipes),
        _tuning_statement(tuning, runs, knob_records),
        (
            "- **Step size vs direction.** Recipes take their own tuned step sizes, so their steps differ in size as "
            "well as direction (the worst-case step below); the matched-budget sweep at the end of this section "
            "compares them at equal worst-case nats per step, budget by budget."
        ),
        _problem_runs(runs),
    ]
    return "\n".join(line for line in lines if line) + "\n"


class Power(NamedTuple):
    """What one arch's paired seeds resolve, from one number: its recipes' paired differences' pooled SD."""

    seeds: int  # the fewest paired seeds among its recipes
    paired_sd: float
    detectable: float  # nats: the difference the paired t-test detects (POWER, SIGNIFICANCE)


def power_by_arch(recipes: Sequence[Row]) -> dict[str, Power]:
    """Per arch with paired differences against `muon`: the one power figure that the summary and the
    protocol both state (the table's column gives each recipe's own)."""
    found = {}
    for arch in sorted({r["arch"] for r in recipes}):
        paired = [r for r in recipes if r["arch"] == arch and r["diff_sd"] is not None]
        paired_sd = _pooled([r["diff_sd"] for r in paired])
        if paired_sd is not None:
            n = min(r["n_paired"] for r in paired)
            found[arch] = Power(n, paired_sd, detectable_difference(paired_sd, n, SIGNIFICANCE, POWER))
    return found


def _power_statement(recipes: list[Row]) -> str:
    """Per arch, `power_by_arch`: what these seeds detect, and the seeds RESOLVE_NATS would need (paired
    t-test, POWER, SIGNIFICANCE); the test loss's own seed SD beside it."""
    parts = []
    for arch, power in power_by_arch(recipes).items():
        seed_sd = _pooled([r["test_loss_sd"] for r in recipes if r["arch"] == arch])
        if power.paired_sd == 0:  # differences identical over the seeds: no t-test, no power
            parts.append(
                f"{arch}: the paired differences do not vary over its {power.seeds} paired seeds (pooled SD "
                "0), so the paired t-test, and its power, are not defined"
            )
            continue
        needed = seeds_needed(RESOLVE_NATS, power.paired_sd, SIGNIFICANCE, POWER)
        parts.append(
            f"{arch}: the paired differences' pooled SD is {num(power.paired_sd, 2)} nats (the test loss's seed SD "
            f"{num(seed_sd, 2)}), so {power.seeds} paired seeds detect {num(power.detectable, 2)} nats and "
            f"{RESOLVE_NATS:g} nats would need {needed if needed else 'more than 10,000'} seeds (power {POWER:g}, "
            f"α = {SIGNIFICANCE:g})"
        )
    more = " More seeds: `lmgeo exp run presets/resolve.yaml`."
    return "- **Power.** " + ("; ".join(parts) + "." + more if parts else "Not measured: fewer than two paired seeds.")


def _tuning_statement(tuning: dict[str, Any] | None, runs: list[Row], knob_records: Sequence[KnobRecord] = ()) -> str:
    """The tuning protocol, whether each run used its tuned knobs, and each knob's lead over its runner-up
    against the seed noise of its trials (`docs/tuning.json`); a knob that record lacks is stated from a
    record that tuned it alone (`knob_records`), or named as never tuned. A knob the main record has that a record
    of its own re-tuned (at a newer protocol) is stated from that record too."""
    if not tuning:
        return "- **Tuning.** No record of the step-size sweep (`docs/tuning.json`) was found."
    p = tuning["protocol"]
    per_knob: dict[tuple[str, str], set[float]] = {}
    for t in tuning["trials"]:
        if t["arch"] == p["arch"]:
            per_knob.setdefault((t["recipe"], t["knob"]), set()).add(t["value"])
    budgets = sorted({len(v) for v in per_knob.values()})
    chosen = {recipe: _chosen_knobs(entry) for recipe, entry in tuning["chosen"].items()}
    used = {r["recipe"]: _knobs(r["head_step"]) for r in runs if r["head_step"]}
    controls = {r: used.pop(r) for r in list(used) if r in RECIPES and RECIPES[r].control_of}
    missing = [(r, k, v) for r, knobs in sorted(used.items()) for k, v in knobs.items() if k not in chosen.get(r, {})]
    alone = {
        (r, k): (path, record)
        for path, record in knob_records
        for r, entry in record["chosen"].items()
        for k in _chosen_knobs(entry)
    }
    untuned = [f"`{r}` {k} (at {v:g})" for r, k, v in missing if (r, k) not in alone]
    tuned_alone = [
        _tuned_alone(r, k, v, *alone[r, k])
        for r, knobs in sorted(used.items())
        for k, v in knobs.items()
        if (r, k) in alone
    ]
    differing = sorted(
        r for r, knobs in used.items() if r in chosen and any(knobs.get(k) != v for k, v in chosen[r].items())
    )
    steps = sorted({r["steps"] for r in runs if r["steps"] and r["arch"] == p["arch"]})
    horizon = f"{p['steps']} steps, as here" if steps == [p["steps"]] else f"{p['steps']} steps (here: {steps})"
    transfer = f" Transfer to other architectures: {p['transfer']}." if p.get("transfer") else ""
    tuned_arch = {r["n_params"] for r in runs if r["arch"] == p["arch"] and r["n_params"]}
    size = (
        f" **The tuned model had {p['n_params']:,} parameters ({p['model']['n_layers']} blocks); this study's "
        f"`{p['arch']}` has {', '.join(f'{n:,}' for n in sorted(tuned_arch))}: the step sizes were not re-tuned "
        "at this size (`lmgeo tune` does it), so a recipe may be off its best step.**"
        if tuned_arch and p.get("n_params") and tuned_arch != {p["n_params"]}
        else ""
    )
    used_note = (
        "Every recipe ran at its tuned knobs."
        if not differing
        else "Not at the tuned knobs here: "
        + ", ".join(f"`{r}` ({_knob_text(used[r])}, tuned {_knob_text(chosen[r])})" for r in differing)
        + "."
    )
    flat = [
        f"`{c['recipe']}` {c['knob']}"
        for c in tuning.get("curves", [])
        if c["margin"] is not None and c["seed_noise"] is not None and c["margin"] < c["seed_noise"]
    ]
    if "curves" not in tuning:
        noise = " The record keeps no seed noise per curve (a record written before `lmgeo tune` measured it)."
    elif flat:
        noise = (
            f" Lead over the runner-up below the trials' seed noise (a flat optimum: the neighbours would do as "
            f"well): {', '.join(flat)}; every curve with its seeds is in `docs/tuning.md`."
        )
    else:
        noise = " Every winner leads its runner-up by more than its trials' seed noise (`docs/tuning.md`)."
    never = (
        f" **Never tuned: {', '.join(untuned)}; re-run `lmgeo tune` to tune every knob at this protocol.**"
        if untuned
        else ""
    )
    if tuned_alone:
        never += f" Tuned alone after the record: {'; '.join(tuned_alone)}."
    if controls:
        never += " " + " ".join(
            f"`{r}` is a control of `{RECIPES[r].control_of}`, at its default knobs ({_knob_text(knobs)}): "
            "not tuned on its own."
            for r, knobs in sorted(controls.items())
        )
    return (
        f"- **Tuning** (`lmgeo tune`, `docs/tuning.md`). The recipes' knobs in the record were chosen on "
        f"`{p['arch']}` with the same budget: {' or '.join(map(str, budgets))} values per knob ({p['grid']}), seeds "
        f"{', '.join(map(str, p['seeds']))} (not the study's), {horizon}, selected on the mean final **val** loss (a "
        f"divergence counts as +∞).{transfer}{noise} {used_note}{never}{size}"
    )


def _tuned_alone(recipe: str, knob: str, used: float, path: str, record: dict[str, Any]) -> str:
    """A knob tuned on its own (`lmgeo tune --recipe … --out …`): its protocol, best value and the value the
    runs used, each with its mean val loss, and the best one's lead against the trials' seed noise; a used value
    worse than the best by more than that noise is called out."""
    p = record["protocol"]
    curve = next(c for c in record["curves"] if c["recipe"] == recipe and c["knob"] == knob)
    means = {point["value"]: point["mean"] for point in curve["points"]}
    chosen = curve["chosen"]
    best = "none (every value diverged)" if chosen is None else f"{chosen:g} ({means[chosen]:.4f})"
    here = f"{means[used]:.4f} mean val loss" if used in means else f"not tried{_neighbours(used, means)}"
    lead = ""
    margin, noise = curve["margin"], curve["seed_noise"]
    if margin is not None and noise is not None:
        side = "below" if margin < noise else "above"
        lead = f"; the best leads its runner-up by {margin:.4f}, {side} the trials' seed noise {noise:.4f}"
    off = ""
    if chosen is not None and used in means and noise is not None and means[used] - means[chosen] > noise:
        off = (
            f" (**the runs here are {means[used] - means[chosen]:.4f} nats of val loss off the best, above that "
            "noise: not at their tuned step**)"
        )
    return (
        f"`{recipe}` {knob} on `{p['arch']}`, {p['steps']} steps of {p['batch_size']} (`{path}`): best {best}, "
        f"{used:g} as run here {here}{lead}{off}"
    )


def _neighbours(value: float, means: dict[float, float]) -> str:
    """The tried values either side of an untried one, with their mean val loss: where it would fall."""
    below = [v for v in means if v < value]
    above = [v for v in means if v > value]
    sides = [f"{v:g}: {means[v]:.4f}" for v in (max(below, default=None), min(above, default=None)) if v is not None]
    return f" (tried either side: {', '.join(sides)})" if len(sides) == 2 else ""


def _knob_text(knobs: dict[str, float]) -> str:
    return " ".join(f"{k}={v:g}" for k, v in knobs.items())


def _chosen_knobs(entry: dict[str, Any]) -> dict[str, float]:
    """A recipe's chosen knobs in the tuning record: {knob: {value, …} or None (every value diverged)}, or, in
    a record written before a recipe had several knobs, one {knob, value, …}."""
    if "knob" in entry:
        return {entry["knob"]: entry["value"]}
    return {knob: choice["value"] for knob, choice in entry.items() if choice}


def _knobs(head_step: str) -> dict[str, float]:
    """`tau=0.8 equi_alignment=0.5` (a run's `head_step`) as {knob: value}."""
    return {k: float(v) for k, _, v in (part.partition("=") for part in head_step.split())}


def _problem_runs(runs: list[Row]) -> str:
    diverged = [f"`{r['run']}` (step {num(r['diverged_at_step'])})" for r in runs if r["diverged"]]
    unfinished = [f"`{r['run']}`" for r in runs if not r["finished"]]
    parts = [f"diverged (left out of the means): {', '.join(diverged)}" if diverged else "no run diverged"]
    if unfinished:
        parts.append(f"stopped before a final `run.json` (logged steps only): {', '.join(unfinished)}")
    return "- **Runs.** " + "; ".join(parts) + "."


GEOMETRY_COLUMNS = (
    "median_hilbert_bound",
    "median_hilbert_realized_train",
    "median_head_alignment",
    "median_head_alignment_hilbert",
    "median_equi_ratio",
    "median_equi_ratio_random",
)


def _geometry_table(runs: list[Row]) -> str:
    """Per arch × recipe, medians over runs of each run's median over logged steps."""
    rows = [
        [arch, f"`{recipe}`", *(median([r[c] for r in rs]) for c in GEOMETRY_COLUMNS)]
        for (arch, recipe), rs in _by_arch_recipe(runs).items()
    ]
    header = [
        "arch",
        "recipe",
        "worst-case step (nats)",
        "realised on its batch (nats)",
        "alignment cos(ΔW, −G)",
        "descent per diameter (`hilbert` of G: ≥ 1)",
        "row spread (min / max distance)",
        "random rows' spread",
    ]
    equi_bound = num(median([r["median_equi_ratio_bound"] for r in runs]))
    note = (
        "Medians over logged steps, then seeds. *Worst-case step*: the most the head step can move the output "
        "distribution in Hilbert distance, so any token's log-probability, for a hidden state no longer than "
        "the probe batch's longest (`hilbert_bound` = max‖h‖·diam(ΔW), SPEC §3.3; exact diameters, a sampled "
        "one gives a lower bound); *realised on its batch*: the largest Hilbert distance, over the positions "
        "of the batch it was computed from, by which it moved their outputs (`hilbert_realized_train`); "
        "*alignment*: `head_alignment`; *descent per diameter*: "
        "−⟨G, ΔW⟩ / (½·diam(ΔW)·Σ‖g̃ᵢ‖), at most 1/J ≈ 1.4 and ≥ 1 for the `hilbert` step of G itself "
        "(`head_alignment_hilbert`, SPEC §3.1); *row spread*: min / max distance between rows of ΔW on a fixed "
        "row sample (`equi_ratio`), against random unit rows (`equi_ratio_random`; no configuration exceeds "
        f"{equi_bound}). The names in parentheses are `runs` columns (`median_<name>`) to query.\n"
    )
    return markdown_table(header, rows) + "\n" + note


_HOLDS = {True: "holds", False: "does not hold", None: "not measured"}


def _study_b_claims(claims: list[Row]) -> str:
    """The bound and the equidistance claims in words (the comparison with muon is in the summary)."""
    rows = [c for c in claims if c["study"] == "B" and c["claim"] != "beats_muon"]
    plain = [
        f"- `hilbert_equi`'s update rows are **not measurably more equidistant than random unit rows** "
        f"({c['subject']}): the interval of the difference includes 0 or lies below it.\n"
        for c in rows
        if c["claim"] == "equi_spreads_rows" and c["holds"] is False
    ]
    stated = [f"- `{c['claim']}` ({c['subject']}): **{_HOLDS[c['holds']]}**: {c['detail']}.\n" for c in rows]
    return "".join(stated + plain)


def appendix(tables: Tables, step_times: dict[str, float]) -> str:
    """The per-run table; `step_times` (run → median wall-clock seconds per step, from the stage's telemetry,
    never a result) where measured."""
    runs = runs_of_kind(tables["runs"])
    if not runs:
        return ""
    rows = [
        [
            f"`{r['run']}`",
            r["head_step"] or "–",
            num(r["final_test_loss"], 4),
            num(r["final_val_loss"], 4),
            num(step_times.get(r["run"])),
            num(r["median_hilbert_bound"]),
            num(r["max_tightness"]),
            "sampled (lower bound)" if r["head_diam_sampled"] else "exact",
        ]
        for r in runs
    ]
    header = [
        "run",
        "head step",
        "test loss",
        "val loss",
        "step time (s)",
        "worst-case step (nats)",
        "largest realised / worst case (probe batch)",
        "diameter",
    ]
    sweep = len(runs_of_kind(tables["runs"], True))
    query = '`lmgeo query "SELECT * FROM runs WHERE matched"`'
    more = f"\nThe matched-budget sweep's {sweep} runs: {query}.\n" if sweep else ""
    return "## Appendix: per run\n\n" + markdown_table(header, rows, "Per run: its losses and head step sizes") + more
