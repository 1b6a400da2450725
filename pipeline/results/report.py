"""The report: ``report.md``, its figures, and ``report.html`` (the same content, self-contained), from the
result tables of ``pipeline.results.aggregate`` (SPEC §2, §3.3, §4.4).

``render_report(tables_dir, out_md, figures_dir, provenance, tuning)`` leads with the answer: a summary (each
claim of the seed per architecture against its null, the head-optimizer comparison with `muon`), then
Study B (protocol, step geometry, figures), Study A (one row per distinct model, claims per layer), an
appendix (the per-run table; where a table is too long it names the `lmgeo query` that selects it) and the
provenance last. A study whose tables are empty is reported as not run. The provenance and the record of the
head step-size tuning (`docs/tuning.json`) are gathered by the caller (`stages.report`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from pipeline.core.contracts import RESULT_TABLES, read_result_tables
from pipeline.core.store import atomic_write
from pipeline.results import figures as fig
from pipeline.results.aggregate import POWER, RESOLVE_NATS, SIGNIFICANCE
from pipeline.results.claims import CLAIMS, INCONCLUSIVE, NOT_SUPPORTED, SUPPORTED, ClaimSummary, summarise
from pipeline.results.html import to_html
from pipeline.study_b.baseline import baseline
from pipeline.study_b.recipes import RECIPES

Row = dict[str, Any]
Tables = dict[str, list[Row]]
NULL_TEXT = {"shuffled": "shuffled pairs", "gaussian": "Gaussian pool", "random": "random patch",
             "other": "other anchor's residual", "zero": "0"}  # fmt: skip


@dataclass(frozen=True)
class Rendered:
    """What was written: the report's line count, and per figure the labels of its panels as drawn
    (`figures.axis_labels`), for the caller to print and the tests to check."""

    lines: int
    figures: dict[str, list[dict[str, Any]]]


def render_report(
    tables_dir: Path, out_md: Path, figures_dir: Path, provenance: dict[str, Any], tuning: dict[str, Any] | None = None
) -> Rendered:
    """Write ``out_md``, ``out_md`` with suffix ``.html`` and the figures (module docstring)."""
    found = read_result_tables(tables_dir) if tables_dir.is_dir() else {}
    tables = {name: found[name].to_pylist() if name in found else [] for name in RESULT_TABLES}
    figures_dir.mkdir(parents=True, exist_ok=True)
    for stale in figures_dir.glob("*.png"):
        stale.unlink()
    figures = _Figures(figures_dir, Path(os.path.relpath(figures_dir, out_md.parent)))
    claims = summarise(tables["claim_tests"])
    text = "\n".join([
        "# lmgeo report\n",
        _summary(tables, claims),
        _study_b(tables, figures, tuning),
        _study_a(tables, claims, figures),
        _appendix(tables),
        _provenance(provenance),
    ])  # fmt: skip
    atomic_write(out_md, text)
    atomic_write(out_md.with_suffix(".html"), to_html(text, out_md.parent, title="lmgeo report"))
    return Rendered(text.count("\n"), figures.labels)


class _Figures:
    """Saves figures, keeps the labels each one was drawn with, and returns the Markdown that shows it."""

    def __init__(self, directory: Path, link_prefix: Path) -> None:
        self.directory = directory
        self.link_prefix = link_prefix
        self.labels: dict[str, list[dict[str, Any]]] = {}

    def show(self, figure: Figure | None, name: str, caption: str) -> str:
        if figure is None:
            return ""
        self.labels[name] = fig.axis_labels(figure)
        figure.savefig(self.directory / f"{name}.png", dpi=100, metadata={"Software": None})
        return f"![{caption}]({(self.link_prefix / f'{name}.png').as_posix()})\n\n*{caption}*\n"


# ---------------------------------------------------------------------------------------- markdown
def _num(x: Any, digits: int = 3) -> str:
    """`digits` significant digits, but whole numbers in full where those would need an exponent (99.9 → 100)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if not isinstance(x, float):
        return str(x)
    short = f"{x:.{digits}g}"
    return f"{x:.0f}" if "e+" in short and abs(x) < 1e6 else short


def _percent(fraction: float | None) -> str:
    return "–" if fraction is None else f"{100 * fraction:.0f}%"


def _interval(mean: Any, low: Any, high: Any, digits: int = 3) -> str:
    """`mean [low, high]`; the mean alone where there is no interval (one seed)."""
    if low is None and high is None:
        return _num(mean, digits)
    return f"{_num(mean, digits)} [{_num(low, digits)}, {_num(high, digits)}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(v if isinstance(v, str) else _num(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _median(values: Sequence[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(finite)) if finite else None


def _pooled(sds: Sequence[float | None]) -> float | None:
    finite = [s for s in sds if s is not None and math.isfinite(s)]
    return float(np.sqrt(np.mean(np.square(finite)))) if finite else None


def _by_arch_recipe(rows: Sequence[Row]) -> dict[tuple[str, str], list[Row]]:
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        if r["arch"] and r["recipe"]:
            groups.setdefault((r["arch"], r["recipe"]), []).append(r)
    return dict(sorted(groups.items(), key=lambda g: (g[0][0], RECIPES.order(g[0][1]))))


# ----------------------------------------------------------------------------------------- summary
def _summary(tables: Tables, claims: list[ClaimSummary]) -> str:
    out = ["## Summary\n"]
    out.append(_claims_summary(claims, bool(tables["geometry"])))
    out.append(_comparison_summary(_runs_of_kind(tables["recipes"])))
    matched = [r for r in _runs_of_kind(tables["recipes"], True) if r["recipe"] != baseline().name]
    if matched:
        out.append("**At equal worst-case nats per step** (the matched-budget ablation, every head step capped at the "
                   f"same budget; against `{baseline().name}` under the cap):\n\n{_plain_comparison(matched)}")  # fmt: skip
    return "\n".join(out)


def _claims_summary(claims: list[ClaimSummary], fitted: bool) -> str:
    """One row per claim, one column per trained architecture (and external model): the verdict, and the
    test that decides it (statistic vs null, effect with its CI)."""
    trained = [c for c in claims if not c.subject.endswith("@init")]
    if not trained:
        why = ("no claim could be tested (no null samples, or fewer than 10 complete anchors per layer)" if fitted
               else "Study A was not run (no fits)")  # fmt: skip
        return f"**Study A (the seed's claims)**: not measured: {why}, so the data says nothing about the claims.\n"
    subjects = sorted({c.subject for c in trained})
    at = {(c.subject, c.claim): c for c in trained}
    rows = []
    for claim in CLAIMS:
        if any((s, claim.name) in at for s in subjects):
            cells = [_claim_cell(at.get((s, claim.name))) for s in subjects]
            rows.append([f"`{claim.name}` (seed: {claim.seed_value})", *cells])
    head = ("**Study A: the seed's claims on the trained models**, each against its null over layers and seeds "
            "(stratified, never pooled), 95% bootstrap CI. A cell gives the verdict over the fit classes (each class "
            "must pass every null), then the test that decides it: statistic vs null → effect [CI] (class, null). "
            "*Inconclusive* means the data cannot tell; `init` and the per-class tests are in Study A below.\n")  # fmt: skip
    table = _table(["claim"] + [s.removesuffix("@final") for s in subjects], rows)
    return f"{head}\n{table}\n{_plain_claims(trained)}"


def _claim_cell(c: ClaimSummary | None) -> str:
    if c is None:
        return "not measured"
    t = c.weakest
    effect = _interval(t["effect"], t["ci_low"], t["ci_high"], 2)
    null = NULL_TEXT.get(t["null"], t["null"])
    versus = f"{_num(t['statistic'], 2)} vs {_num(t['null_statistic'], 2)}"
    return f"**{c.verdict}** · {versus} → {effect} ({t['fn']}, {null})"


def _plain_claims(trained: list[ClaimSummary]) -> str:
    """The table in words: which claims hold everywhere, nowhere, and where the data cannot decide."""
    by_claim: dict[str, set[str]] = {}
    for c in trained:
        by_claim.setdefault(c.claim, set()).add(c.verdict)
    groups = {
        "Supported wherever measured": [n for n, v in by_claim.items() if v == {SUPPORTED}],
        "Not supported anywhere": [n for n, v in by_claim.items() if v == {NOT_SUPPORTED}],
        "The data cannot decide (inconclusive everywhere)": [n for n, v in by_claim.items() if v == {INCONCLUSIVE}],
        "Differs by architecture or class": [n for n, v in by_claim.items()
                                             if len(v) > 1 or not v <= {SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE}],
    }  # fmt: skip
    lines = [f"- {label}: {', '.join(f'`{n}`' for n in names)}." for label, names in groups.items() if names]
    return "\n".join(lines) + "\n"


def _comparison_summary(recipes: list[Row]) -> str:
    """Per arch and recipe: the final test loss, and the paired comparison with `muon` in numbers and in words."""
    reference = baseline().name
    rows = [r for r in recipes if r["recipe"] != reference]
    if not rows:
        return "**Study B (head optimizers)**: not measured, Study B was not run (no training logs).\n"
    head = (f"**Study B: each head recipe against `{reference}`** on the held-out test split: final test loss over "
            f"seeds, and the difference to `{reference}` on the same seeds (paired t-interval, not adjusted; p of the "
            f"paired t-test, Holm-adjusted over the arch's recipes, decides the reading). *Detectable Δ*: the "
            f"difference these seeds detect with power {POWER:g}.\n")  # fmt: skip
    base = {r["arch"]: r["test_loss_mean"] for r in recipes if r["recipe"] == reference}
    body = [[r["arch"], f"`{r['recipe']}`", r["n_seeds"],
             _interval(r["test_loss_mean"], r["test_loss_ci_low"], r["test_loss_ci_high"], 4), _num(base.get(r["arch"]), 4),
             "–" if r["diff_vs_muon"] is None else _interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]),
             _num(r["p_vs_muon_holm"], 2), _num(r["detectable_diff"], 2), _reading(r)] for r in rows]  # fmt: skip
    header = ["arch", "recipe", "seeds", "test loss [95% CI]", f"{reference}'s", f"Δ vs {reference} [95% CI]",
              "Holm p", "detectable Δ", "reading"]  # fmt: skip
    return f"{head}\n{_table(header, body)}\n{_plain_comparison(rows)}"


def _plain_comparison(rows: list[Row]) -> str:
    """The table in words: which recipes are resolved below or above muon, and which the seeds cannot tell."""
    readings: dict[str, list[str]] = {}
    for r in rows:
        reading = _reading(r)
        key = reading if reading in ("lower than muon", "higher than muon") else "unresolved"
        key = "not compared" if r["diff_vs_muon"] is None else key
        readings.setdefault(key, []).append(f"`{r['recipe']}` ({r['arch']})")
    detectable = _median([r["detectable_diff"] for r in rows])
    lines = [f"- Lower test loss than `muon`: {', '.join(readings.get('lower than muon', [])) or 'no recipe'}.",
             f"- Higher than `muon`: {', '.join(readings.get('higher than muon', [])) or 'no recipe'}."]  # fmt: skip
    if "not compared" in readings:
        lines.append(f"- Not compared (no `muon` run on the same seeds, or every run diverged): "
                     f"{', '.join(readings['not compared'])}.")  # fmt: skip
    if "unresolved" in readings:
        limit = f" (differences below about {_num(detectable, 2)} nats are within seed noise)" if detectable else ""
        lines.append(f"- Not resolved from `muon` with these seeds{limit}: {', '.join(readings['unresolved'])}.")
    return "\n".join(lines) + "\n"


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
    return f"no difference resolved (these seeds detect ≥ {_num(r['detectable_diff'], 2)} nats)"


# ----------------------------------------------------------------------------------------- Study B
def _runs_of_kind(rows: list[Row], matched: bool = False) -> list[Row]:
    """The rows of the default runs (or of the matched-budget runs) of a `runs` or `recipes` table."""
    return [r for r in rows if bool(r["matched"]) == matched]


def _study_b(tables: Tables, figures: _Figures, tuning: dict[str, Any] | None) -> str:
    runs, curves, recipes = _runs_of_kind(tables["runs"]), tables["curves"], _runs_of_kind(tables["recipes"])
    out = ["## Study B: LM-head update geometry\n"]
    if not runs:
        return out[0] + "\nStudy B was not run: there are no training logs.\n"
    out.append(_protocol(runs, recipes, tuning))
    out.append(figures.show(fig.vs_muon(recipes, runs), "study_b_vs_muon",
                            "Final test loss minus muon's on the same seed: seeds (dots), mean and 95% t-interval."))  # fmt: skip
    out.append(figures.show(fig.val_loss(curves, runs), "study_b_val_loss",
                            "Validation loss over training, per recipe (mean over seeds)."))  # fmt: skip
    out.append("### Head step geometry\n")
    out.append(_geometry_table(runs))
    out.append(_study_b_claims(tables["claims"]))
    out.append(figures.show(fig.head_step(curves, runs), "study_b_head_step",
                            "Head step per recipe (median over seeds): size in Hilbert units, tightness of the bound "
                            "on exact-diameter steps (≤ 1, SPEC §3.1), spread of the update's rows (dotted: random unit rows)."))  # fmt: skip
    out.append(_matched_budget(_runs_of_kind(tables["runs"], True), _runs_of_kind(tables["recipes"], True), figures))
    return "\n".join(part for part in out if part)


def _matched_budget(runs: list[Row], recipes: list[Row], figures: _Figures) -> str:
    """The matched-budget ablation: every recipe again with its head step capped at the same worst-case
    Hilbert budget, against `muon` under the same cap, and what the cap did to each recipe."""
    out = ["### Step size vs direction: the matched-budget ablation\n"]
    if not runs:
        return out[0] + ("Not in this study (`train.matched_budget` is null): recipes differ in step size as well "
                         "as direction.\n")  # fmt: skip
    reference = baseline().name
    budgets = sorted({r["head_budget_tau"] for r in runs if r["head_budget_tau"] is not None})
    seeds = sorted({r["seed"] for r in runs if r["seed"] is not None})
    out.append(f"Every recipe trained again on seeds {', '.join(map(str, seeds))} with its head step (decay included) "
               f"scaled down where needed so that diam(ΔW) ≤ tau_t / r_t, tau = {', '.join(map(_num, budgets))} nats "
               f"on the head's schedule, r_t = max ‖h‖ over the batch: recipes compare at equal worst-case nats per "
               f"step, and where the cap binds only the direction differs. Δ is against `{reference}` under the same "
               "cap on the same seeds (paired t-interval; Holm over the arch's recipes); *cap's effect*: the matched "
               "run's test loss minus the same recipe's default run on the same seed.\n")  # fmt: skip
    capped = {key: _median([r["frac_steps_capped"] for r in rs]) for key, rs in _by_arch_recipe(runs).items()}
    body = [[r["arch"], f"`{r['recipe']}`", r["n_seeds"], _percent(capped.get((r["arch"], r["recipe"]))),
             _interval(r["test_loss_mean"], r["test_loss_ci_low"], r["test_loss_ci_high"], 4),
             "–" if r["diff_vs_muon"] is None else _interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]),
             _num(r["p_vs_muon_holm"], 2), _reading(r) if r["recipe"] != reference else "–",
             _interval(r["cap_effect"], r["cap_effect_ci_low"], r["cap_effect_ci_high"])] for r in recipes]  # fmt: skip
    header = ["arch", "recipe", "seeds", "steps capped", "test loss [95% CI]", f"Δ vs {reference} [95% CI]",
              "Holm p", "reading", "cap's effect [95% CI]"]  # fmt: skip
    out.append(_table(header, body))
    out.append(_plain_comparison([r for r in recipes if r["recipe"] != reference]))
    out.append(figures.show(fig.vs_muon(recipes, runs), "study_b_matched_vs_muon",
                            f"Matched budget: final test loss minus {reference}'s under the same cap, same seed."))  # fmt: skip
    return "\n".join(out)


def _protocol(runs: list[Row], recipes: list[Row], tuning: dict[str, Any] | None) -> str:
    """What an optimizer researcher needs to trust the comparison (SPEC §3.2)."""
    seeds = sorted({r["seed"] for r in runs if r["seed"] is not None})
    lines = [
        "### Protocol\n",
        ("- **Splits.** Train, val and test are split by document. Tuning and the curves use val; recipes are "
         "compared on test, read once per run after its last step (no tuning run reads it)."),
        (f"- **Seeds.** {len(seeds)} seeds ({', '.join(map(str, seeds))}) per recipe; a seed fixes the initialisation "
         "and the batch order, so differences are paired. Only the head's optimizer differs (`adamw`: every matrix); "
         "all recipes run the same steps and tokens."),
        _power_statement(recipes),
        _tuning_statement(tuning, runs),
        ("- **Step size vs direction.** Recipes take their own tuned step sizes, so their steps differ in size as "
         "well as direction (`hilbert_bound` below); the matched-budget ablation at the end of this section "
         "compares them at equal worst-case nats per step."),
        _problem_runs(runs),
    ]  # fmt: skip
    return "\n".join(line for line in lines if line) + "\n"


def _power_statement(recipes: list[Row]) -> str:
    """Per arch: the measured seed SD and paired SD, what these seeds detect, and what RESOLVE_NATS needs."""
    parts = []
    for arch in sorted({r["arch"] for r in recipes}):
        paired = [r for r in recipes if r["arch"] == arch and r["diff_sd"] is not None]
        if not paired:
            continue
        needed = [r["seeds_to_resolve"] for r in paired if r["seeds_to_resolve"] is not None]
        seed_sd = _pooled([r["test_loss_sd"] for r in recipes if r["arch"] == arch])
        paired_sd = _pooled([r["diff_sd"] for r in paired])
        detectable = _median([r["detectable_diff"] for r in paired])
        parts.append(
            f"{arch}: seed SD of the test loss {_num(seed_sd, 2)} nats, of the paired difference {_num(paired_sd, 2)}; "
            f"{min(r['n_paired'] for r in paired)} paired seeds detect {_num(detectable, 2)} nats (power {POWER:g}, "
            f"α = {SIGNIFICANCE:g}, median over recipes); {RESOLVE_NATS:g} nats would need "
            f"{max(needed) if needed else 'more than 10,000'} seeds"
        )
    more = " More seeds: `dvc exp run $(lmgeo preset presets/resolve.yaml)`."
    return "- **Power.** " + ("; ".join(parts) + "." + more if parts else "Not measured: fewer than two paired seeds.")


def _tuning_statement(tuning: dict[str, Any] | None, runs: list[Row]) -> str:
    if not tuning:
        return "- **Tuning.** No record of the head step-size sweep (`docs/tuning.json`) was found."
    p = tuning["protocol"]
    per_recipe: dict[str, set[tuple[str, float]]] = {}
    for t in tuning["trials"]:
        if t["arch"] == p["arch"]:
            per_recipe.setdefault(t["recipe"], set()).add((t["knob"], t["value"]))
    budgets = sorted({len(v) for v in per_recipe.values()})
    chosen = {recipe: f"{c['knob']}={c['value']:g}" for recipe, c in tuning["chosen"].items() if c}
    used = {r["recipe"]: r["head_step"] for r in runs if r["head_step"]}
    differing = sorted(r for r, step in used.items() if r in chosen and chosen[r] != step)
    steps = sorted({r["steps"] for r in runs if r["steps"]})
    horizon = f"{p['steps']} steps, as here" if steps == [p["steps"]] else f"{p['steps']} steps (here: {steps})"
    transfer = f" Transfer to other architectures: {p['transfer']}." if p.get("transfer") else ""
    tuned_arch = {r["n_params"] for r in runs if r["arch"] == p["arch"] and r["n_params"]}
    size = (f" **The tuned model had {p['n_params']:,} parameters ({p['model']['n_layers']} blocks); this study's "
            f"`{p['arch']}` has {', '.join(f'{n:,}' for n in sorted(tuned_arch))}: the step sizes were not re-tuned "
            "at this size (`lmgeo tune` does it), so a recipe may be off its best step.**"
            if tuned_arch and p.get("n_params") and tuned_arch != {p["n_params"]} else "")  # fmt: skip
    used_note = ("Every recipe ran at its tuned step." if not differing else "Not at the tuned step here: "
                 + ", ".join(f"`{r}` ({used[r]}, tuned {chosen[r]})" for r in differing) + ".")  # fmt: skip
    return (
        f"- **Tuning** (`lmgeo tune`, `docs/tuning.md`). Every recipe's head step size, baselines included, was "
        f"chosen on `{p['arch']}` with the same budget: {' or '.join(map(str, budgets))} step sizes per recipe "
        f"({p['grid']}), seeds {', '.join(map(str, p['seeds']))} (not the study's), {horizon}, selected on the "
        f"mean final **val** loss (a divergence counts as +∞).{transfer} {used_note}{size}"
    )


def _problem_runs(runs: list[Row]) -> str:
    diverged = [f"`{r['run']}` (step {_num(r['diverged_at_step'])})" for r in runs if r["diverged"]]
    unfinished = [f"`{r['run']}`" for r in runs if not r["finished"]]
    parts = [f"diverged (left out of the means): {', '.join(diverged)}" if diverged else "no run diverged"]
    if unfinished:
        parts.append(f"stopped before a final `run.json` (logged steps only): {', '.join(unfinished)}")
    return "- **Runs.** " + "; ".join(parts) + "."


GEOMETRY_COLUMNS = ("median_hilbert_bound", "median_hilbert_realized_train", "median_head_alignment",
                    "median_head_alignment_hilbert", "median_equi_ratio", "median_equi_ratio_random")  # fmt: skip


def _geometry_table(runs: list[Row]) -> str:
    """Per arch × recipe, medians over runs of each run's median over logged steps."""
    rows = [[arch, f"`{recipe}`", *(_median([r[c] for r in rs]) for c in GEOMETRY_COLUMNS)]
            for (arch, recipe), rs in _by_arch_recipe(runs).items()]  # fmt: skip
    header = ["arch", "recipe", "hilbert_bound (nats)", "d_H on its batch", "cos(ΔW, −G)", "descent / hilbert's",
              "equi_ratio", "random rows"]  # fmt: skip
    note = ("Medians over logged steps, then seeds. *d_H on its batch*: the largest change of a token's log-probability "
            "the head step made on the batch it was computed from; *descent / hilbert's*: −⟨G, ΔW⟩ per unit diameter "
            "relative to the `hilbert` step (SPEC §3.3); *equi_ratio*: min/max row distance of ΔW on a fixed row "
            f"sample, against random unit rows (no configuration exceeds {_num(_median([r['median_equi_ratio_bound'] for r in runs]))}).\n")  # fmt: skip
    return _table(header, rows) + "\n" + note


_HOLDS = {True: "holds", False: "does not hold", None: "not measured"}


def _study_b_claims(claims: list[Row]) -> str:
    """The bound and the equidistance claims in words (the comparison with muon is in the summary)."""
    rows = [c for c in claims if c["study"] == "B" and c["claim"] != "beats_muon"]
    return "".join(f"- `{c['claim']}` ({c['subject']}): **{_HOLDS[c['holds']]}**: {c['detail']}.\n" for c in rows)


# ----------------------------------------------------------------------------------------- Study A
def _study_a(tables: Tables, claims: list[ClaimSummary], figures: _Figures) -> str:
    out = ["## Study A: layer-update geometry\n"]
    if not tables["geometry"]:
        return out[0] + "\nStudy A was not run: there are no fits.\n"
    out.append(
        "Per model and layer a tokenwise map T is fitted on each anchor's nearest neighbours; Δ_full = h_{l+1} − h_l "
        "splits into Δ_tok = T(h_l) − h_l and a residual r (SPEC §4.2). Each claim is tested against nulls (SPEC "
        "§4.5): the geometric ones against the same fits on shuffled pairs and on a Gaussian pool, the functional "
        "ones against patches of norm ‖r‖ in a random direction or along another anchor's residual. Effect = "
        "statistic − null, stratified over layers and seeds. **Supported**: CI above 0 and effect ≥ the claim's "
        "margin; **not supported**: CI below the margin; **inconclusive**: otherwise.\n"
    )  # fmt: skip
    out.append(_models_table(tables["geometry_pooled"], tables["geometry"]))
    if claims:
        out.append("### Init vs trained\n")
        out.append(_init_vs_final(claims))
    out.append(figures.show(fig.claims_by_layer(tables["claim_tests"]), "study_a_claims_by_layer",
                            "Verdict of each claim per layer (colour: +1 supported, −1 not supported, averaged over "
                            "classes; each class combined over its nulls)."))  # fmt: skip
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
               f"{max(g['n_degenerate'] / g['n'] for g in layers):.0%}",
               (f"{max(c['n_nonfinite'] or 0 for c in classes)} pool tokens, "
                f"{max(c['n_nonfinite_values'] for c in classes)} anchors")]  # fmt: skip
        for fn in fns:
            p = at.get((model, fn))
            bound = _median([g["median_cos_bound"] for g in layers if g["fn"] == fn])
            fit = f"{_num(p['layer_median_rel_err'], 2)} · {_num(p['layer_median_cos_full_tok'], 2)}" if p else None
            row.append(f"{fit} ≥ {_num(bound, 2)}" if fit else "–")
        rows.append(row)
    note = ("Per distinct model (`@init`: each distinct initialisation once). *distinct inputs*: fewest distinct h_l "
            "in a layer's pool (SPEC asks ≥ 10·k); *degenerate*: largest share of anchors in a layer whose neighbourhood "
            "cannot identify the map (left out); *excluded non-finite*: pool tokens and anchors left out of every "
            "statistic. Per class: median over layers of rel_err · cos_full_tok ≥ √(1 − rel_err²); the bound follows "
            "from rel_err alone, so cos_full_tok near 1 is no evidence beyond a small residual. Per layer: "
            "`lmgeo query \"SELECT * FROM geometry WHERE sample = 'real'\"`.\n")  # fmt: skip
    header = ["model", "layers", "distinct inputs", "k", "degenerate", "excluded non-finite"] + [
        f"{fn}: rel_err · cos ≥ bound" for fn in fns]  # fmt: skip
    return "### Models\n\n" + _table(header, rows) + "\n" + note + _ill_posed(real)


def _ill_posed(real: list[Row]) -> str:
    """In words, where the data cannot support per-layer statements: pools with fewer than 10·k distinct
    inputs, and layers where some neighbourhoods cannot identify the map."""
    small = sorted({f"`{g['model']}` layer {g['layer']}" for g in real
                    if g["n_distinct"] is not None and g["n_distinct"] < 10 * g["k"]})  # fmt: skip
    degenerate = sorted({f"`{g['model']}` layer {g['layer']}" for g in real if g["n_degenerate"]})
    lines = []
    if small:
        lines.append(f"**Not well posed**: fewer than 10·k distinct inputs in {len(small)} (model, layer) pools "
                     f"({', '.join(small[:4])}{', …' if len(small) > 4 else ''}); the claims there rest on repeated "
                     "tokens and should not be read as evidence either way.")  # fmt: skip
    if degenerate:
        lines.append(f"Degenerate neighbourhoods (left out) in {len(degenerate)} (model, layer) pairs: the verdicts "
                     "there rest on the remaining anchors only.")  # fmt: skip
    return "".join(f"\n{line}\n" for line in lines)


def _init_vs_final(claims: list[ClaimSummary]) -> str:
    """Is the structure there at random initialisation, or does training make it? Per claim and subject."""
    at = {(c.subject, c.claim): c for c in claims}
    bases = sorted({c.subject.rsplit("@", 1)[0] for c in claims})
    rows = []
    for claim in CLAIMS:
        trained = [at.get((f"{b}@final", claim.name)) or at.get((b, claim.name)) for b in bases]
        cells = [_trained_vs_init(t, at.get((f"{b}@init", claim.name))) for b, t in zip(bases, trained, strict=True)]
        if any(cell != "–" for cell in cells):
            rows.append([f"`{claim.name}`", *cells])
    return _table(["claim"] + [f"{b}: trained / init" for b in bases], rows)


def _trained_vs_init(final: ClaimSummary | None, init: ClaimSummary | None) -> str:
    if final is None and init is None:
        return "–"
    return f"{final.verdict if final else '–'} / {init.verdict if init else '–'}"


# ---------------------------------------------------------------------------------------- appendix
def _appendix(tables: Tables) -> str:
    runs = tables["runs"]
    if not runs:
        return ""
    rows = [[f"`{r['run']}`", r["head_step"] or "–", _num(r["final_test_loss"], 4), _num(r["final_val_loss"], 4),
             _num(r["median_step_time_s"]), _num(r["median_hilbert_bound"]), _num(r["max_tightness"]),
             "sampled (lower bound)" if r["head_diam_sampled"] else "exact"] for r in runs]  # fmt: skip
    header = ["run", "head step", "test loss", "val loss", "step time (s)", "hilbert_bound", "max tightness", "diameter"]
    return "## Appendix: per run\n\n" + _table(header, rows)


def _provenance(provenance: dict[str, Any]) -> str:
    """Git revision, params hash, seeds, packages, hardware and checksums: one line per entry."""
    if not provenance:
        return "## Provenance\n\nNo provenance was recorded.\n"
    lines = []
    for key, value in provenance.items():
        if isinstance(value, dict) and any(isinstance(v, dict) for v in value.values()):
            lines.append(f"- **{key}**:")
            lines += [f"  - {k}: {_flat(v)}" for k, v in value.items()]
        else:
            lines.append(f"- **{key}**: {_flat(value)}")
    return "## Provenance\n\n" + "\n".join(lines) + "\n"


def _flat(value: Any) -> str:
    """A mapping on one line (`key` `value`, ...), a list joined by commas, a scalar in code quotes."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_flat(v)}" for k, v in value.items()) or "none"
    if isinstance(value, list):
        return f"`{', '.join(map(str, value))}`" if value else "none"
    return f"`{value}`"
