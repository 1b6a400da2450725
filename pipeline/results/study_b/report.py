"""Study B's part of the report (`pipeline.results.report`): the comparison with `muon` in the summary (in
words, its figures, the table) and its one-sentence finding, the
section (protocol, power, tuning, step geometry, claims, the matched-budget ablation, figures) and the
per-run appendix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.results.common import Figures, Row, Tables, interval, markdown_table, median, num, percent
from pipeline.results.study_b import figures as fig
from pipeline.results.study_b.tables import BINDING_SHARE, POWER, RESOLVE_NATS, SIGNIFICANCE
from pipeline.study_b.baseline import baseline
from pipeline.study_b.recipes import RECIPES


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
def summary(tables: Tables, figures: Figures) -> str:
    """The comparison with `muon` for a newcomer: in words (at the recipes' own step sizes, then at equal
    worst-case nats per step), the forest plot beside the budget sweep, then the table."""
    reference = baseline().name
    runs, recipes = runs_of_kind(tables["runs"]), runs_of_kind(tables["recipes"])
    rows = [r for r in recipes if r["recipe"] != reference]
    if not rows:
        return "**Study B (head optimizers)**: not measured, Study B was not run (no training logs).\n"
    out = [f"At each recipe's own tuned step size, final test loss against `{reference}` on the same seeds:\n",
           plain_comparison(rows)]  # fmt: skip
    if tables["envelope"]:
        sweep = sweep_summary(runs_of_kind(tables["recipes"], True), tables["envelope"])
        out.append("**At equal worst-case nats per step** (the matched-budget sweep: every head step capped at the "
                   f"same budget, against `{reference}` under that cap):\n\n{sweep}")  # fmt: skip
    out.append(figures.beside([
        (fig.vs_muon(recipes, runs), "study_b_vs_muon",
         f"Left: each recipe's final test loss minus `{reference}`'s on the same seed (dots: seeds; bar: mean and "
         f"95% t-interval); a bar wholly left of 0 beats `{reference}`, wholly right loses to it."),
        (fig.loss_vs_budget(runs_of_kind(tables["recipes"], True)), "study_b_loss_vs_budget",
         "Right: the matched-budget sweep, final test loss against the head budget (log axis; mean and 95% "
         "t-interval over seeds; square: the recipe uncapped); lines that cross mean the verdict depends on the "
         "budget."),
    ]))  # fmt: skip
    out.append(comparison_table(recipes))
    return "\n".join(part for part in out if part)


def finding(recipes: list[Row]) -> str | None:
    """Study B in one sentence per architecture compared: how many recipes are resolved below, above `muon`,
    and which the seeds cannot tell (README's findings)."""
    reference = baseline().name
    sentences = []
    for arch in sorted({r["arch"] for r in recipes if r["recipe"] != reference and r["diff_vs_muon"] is not None}):
        rows = [r for r in recipes if r["arch"] == arch and r["recipe"] != reference and r["diff_vs_muon"] is not None]
        by_reading: dict[str, list[str]] = {}
        for r in rows:
            by_reading.setdefault(_reading(r) if _reading(r).endswith("than muon") else "unresolved", []).append(
                f"`{r['recipe']}`")
        lower, higher, unresolved = (by_reading.get(k, []) for k in ("lower than muon", "higher than muon",
                                                                          "unresolved"))  # fmt: skip
        sentences.append(
            f"Study B ({arch}): at their own tuned step sizes, {_count(lower)} of {len(rows)} head recipes reach a "
            f"lower test loss than `{reference}`, {_count(higher)} a higher one, and {_count(unresolved)} "
            "cannot be told apart from it with these seeds.")  # fmt: skip
    return " ".join(sentences) or None


def _count(recipes: list[str]) -> str:
    return f"{len(recipes)} ({', '.join(recipes)})" if recipes else "none"


def comparison_table(recipes: list[Row]) -> str:
    """Per arch and recipe: the final test loss, and the paired comparison with `muon` in numbers and in words."""
    reference = baseline().name
    rows = [r for r in recipes if r["recipe"] != reference]
    head = (f"The numbers, on the held-out test split: final test loss over seeds, and the difference to "
            f"`{reference}` on the same seeds (paired t-interval, not adjusted; p of the paired t-test, Holm-adjusted "
            f"over the arch's recipes, decides the reading). *Detectable Δ*: the difference these seeds detect with "
            f"power {POWER:g}.\n")  # fmt: skip
    base = {r["arch"]: r["test_loss_mean"] for r in recipes if r["recipe"] == reference}
    body = [[r["arch"], f"`{r['recipe']}`", r["n_seeds"],
             interval(r["test_loss_mean"], r["test_loss_ci_low"], r["test_loss_ci_high"], 4),
             num(base.get(r["arch"]), 4),
             "–" if r["diff_vs_muon"] is None else interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]),
             num(r["p_vs_muon_holm"], 2), num(r["detectable_diff"], 2), _reading(r)] for r in rows]  # fmt: skip
    header = ["arch", "recipe", "seeds", "test loss [95% CI]", f"{reference}'s", f"Δ vs {reference} [95% CI]",
              "Holm p", "detectable Δ", "reading"]  # fmt: skip
    return f"{head}\n{markdown_table(header, body)}"


def plain_comparison(rows: list[Row]) -> str:
    """The table in words: which recipes are resolved below or above muon, and which the seeds cannot tell."""
    readings: dict[str, list[str]] = {}
    for r in rows:
        reading = _reading(r)
        key = reading if reading in ("lower than muon", "higher than muon") else "unresolved"
        key = "not compared" if r["diff_vs_muon"] is None else key
        readings.setdefault(key, []).append(f"`{r['recipe']}` ({r['arch']})")
    detectable = median([r["detectable_diff"] for r in rows])
    lines = [f"- Lower test loss than `muon`: {', '.join(readings.get('lower than muon', [])) or 'no recipe'}.",
             f"- Higher than `muon`: {', '.join(readings.get('higher than muon', [])) or 'no recipe'}."]  # fmt: skip
    if "not compared" in readings:
        lines.append(f"- Not compared (no `muon` run on the same seeds, or every run diverged): "
                     f"{', '.join(readings['not compared'])}.")  # fmt: skip
    if "unresolved" in readings:
        limit = f" (differences below about {num(detectable, 2)} nats are within seed noise)" if detectable else ""
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
    return f"no difference resolved (these seeds detect ≥ {num(r['detectable_diff'], 2)} nats)"


# ----------------------------------------------------------------------------------------- section
def runs_of_kind(rows: list[Row], matched: bool = False) -> list[Row]:
    """The rows of the default runs (or of the matched-budget runs) of a `runs` or `recipes` table."""
    return [r for r in rows if bool(r["matched"]) == matched]


def section(tables: Tables, figures: Figures, tuning: dict[str, Any] | None) -> str:
    runs, curves, recipes = runs_of_kind(tables["runs"]), tables["curves"], runs_of_kind(tables["recipes"])
    out = ["## Study B: LM-head update geometry\n"]
    if not runs:
        return out[0] + "\nStudy B was not run: there are no training logs.\n"
    out.append(_protocol(runs, recipes, tuning))
    out.append(figures.show(fig.val_loss(curves, runs), "study_b_val_loss",
                            "Validation loss over training per recipe (mean over seeds): where the curves separate, "
                            "and whether they still fall at the last step."))  # fmt: skip
    out.append("### Head step geometry\n")
    out.append(_geometry_table(runs))
    out.append(_study_b_claims(tables["claims"]))
    out.append(figures.show(fig.head_step(curves, runs), "study_b_head_step",
                            "Head step per recipe (median over seeds): its size in Hilbert units (which recipes take "
                            "the largest steps), the bound's tightness on exact-diameter steps (≤ 1, SPEC §3.1: a "
                            "value near 1 means the bound is nearly attained), and how evenly the update's rows are "
                            "spread (dotted: random unit rows; only `hilbert_equi` should reach it)."))  # fmt: skip
    study_steps = sorted({r["steps"] for r in runs if r["steps"]})
    out.append(_matched_budget(runs_of_kind(tables["runs"], True), runs_of_kind(tables["recipes"], True),
                               tables["envelope"], figures, study_steps))  # fmt: skip
    return "\n".join(part for part in out if part)


def _matched_budget(runs: list[Row], recipes: list[Row], envelope: list[Row], figures: Figures,
                    study_steps: list[int]) -> str:  # fmt: skip
    """The matched-budget sweep: every recipe again at each budget, against `muon` under the same cap; the
    share of steps each cap scaled and what it cost; each recipe at its best budget (the envelope).
    `study_steps`: the default runs' steps, to say when the sweep's runs are shorter."""
    out = ["### Step size vs direction: the matched-budget sweep\n"]
    if not runs:
        return out[0] + ("Not in this study (`train.matched_budget` is null): recipes differ in step size as well "
                         "as direction.\n")  # fmt: skip
    reference = baseline().name
    budgets = sorted({r["head_budget_tau"] for r in recipes if r["head_budget_tau"] is not None})
    seeds = sorted({r["seed"] for r in runs if r["seed"] is not None})
    steps = sorted({r["steps"] for r in runs if r["steps"]})
    out.append(f"Every recipe trained again on seeds {', '.join(map(str, seeds))} for {', '.join(map(str, steps))} "
               f"steps at each budget tau ∈ {{{', '.join(map(num, budgets))}}} nats, its head step (decay included) "
               "scaled down where needed so that diam(ΔW) ≤ tau_t / r_t (tau on the head's schedule, r_t = max ‖h‖ "
               "over the batch), and once uncapped at the same steps as the sweep's reference. Where the cap binds "
               f"(it scales ≥ {percent(BINDING_SHARE)} of a recipe's steps) the budget, not the recipe's own step "
               f"size, sets how far the head moves, and only the direction differs. Δ is against `{reference}` "
               "under the same cap on the same seeds (paired t-interval; Holm over the arch's recipes at that "
               "budget); † marks a budget where the cap binds for one side only. *Cap's effect*: the capped run's "
               "test loss minus the uncapped sweep run's, same seed. The sweep's runs are in table `runs` "
               "(`matched`), its rows in `recipes` (`head_budget_tau`), its envelope in `envelope`."
               + _shorter_note(steps, study_steps) + "\n")  # fmt: skip
    out.append(_budget_matrix(recipes, budgets, reference))
    out.append(_envelope_table(envelope, reference))
    out.append("The sweep's figure (test loss against the budget) is in the summary.\n")
    return "\n".join(part for part in out if part)


def _shorter_note(sweep_steps: list[int], study_steps: list[int]) -> str:
    if not study_steps or sweep_steps == study_steps or not sweep_steps:
        return ""
    return (f" **The sweep's runs take {', '.join(map(str, sweep_steps))} steps, the comparison above "
            f"{', '.join(map(str, study_steps))}** (to keep the study's time; `presets/sweep.yaml` runs the full "
            "horizon): its losses are those of shorter runs, and its uncapped references are as short.")


def _budget_matrix(recipes: list[Row], budgets: list[float], reference: str) -> str:
    """Recipes × budgets: Δ vs muon under the same cap, and the share of steps capped / the cap's effect."""
    cell = {(r["arch"], r["recipe"], r["head_budget_tau"]): r for r in recipes}
    muon_binds = {(r["arch"], r["head_budget_tau"]): r["cap_binds"] for r in recipes if r["recipe"] == reference}
    delta_rows, cap_rows = [], []
    for arch, recipe in sorted({(r["arch"], r["recipe"]) for r in recipes}, key=lambda k: (k[0], RECIPES.order(k[1]))):
        here = [cell.get((arch, recipe, b)) for b in budgets]
        label = [arch, f"`{recipe}`"]
        if recipe != reference:
            delta_rows.append(label + [_delta_cell(r, muon_binds.get((arch, r["head_budget_tau"]))) if r else "–"
                                       for r in here])  # fmt: skip
        cap_rows.append(label + [f"{percent(r['frac_steps_capped'])} / {num(r['cap_effect'])}" if r else "–"
                                 for r in here])  # fmt: skip
    header = ["arch", "recipe", *(f"tau {num(b)}" for b in budgets)]
    return (f"Δ vs `{reference}` under the same cap (nats, [95% CI]):\n\n{markdown_table(header, delta_rows)}\n"
            f"Share of steps capped / cap's effect (nats):\n\n{markdown_table(header, cap_rows)}")  # fmt: skip


def _delta_cell(r: Row, muon_binds: bool | None) -> str:
    if r["diff_vs_muon"] is None:
        return "–"
    one_side = "" if bool(r["cap_binds"]) == bool(muon_binds) or not (r["cap_binds"] or muon_binds) else " †"
    return interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]) + one_side


def _envelope_table(envelope: list[Row], reference: str) -> str:
    rows = [[r["arch"], f"`{r['recipe']}`", num(r["best_tau"]),
             interval(r["test_loss_mean"], r["test_loss_ci_low"], r["test_loss_ci_high"], 4),
             num(r["uncapped_test_loss"], 4),
             "–" if r["diff_vs_muon"] is None else interval(r["diff_vs_muon"], r["diff_ci_low"], r["diff_ci_high"]),
             num(r["p_vs_muon_holm"], 2)] for r in envelope]  # fmt: skip
    header = ["arch", "recipe", "best budget", "test loss there [95% CI]", "uncapped", f"Δ vs {reference} at its best",
              "Holm p"]  # fmt: skip
    return ("The envelope, each recipe at its best budget (chosen on the mean final val loss, read on test), the "
            f"fair overall comparison of directions:\n\n{markdown_table(header, rows)}")


def _resolved(r: Row) -> bool:
    """A difference the seeds resolve: the interval excludes 0, and the Holm-adjusted test agrees where the
    seeds are enough to test."""
    low, high, p = r["diff_ci_low"], r["diff_ci_high"], r["p_vs_muon_holm"]
    excludes_zero = low is not None and high is not None and (low > 0 or high < 0)
    return excludes_zero and (p is None or p < SIGNIFICANCE)


def sweep_summary(recipes: list[Row], envelope: list[Row]) -> str:
    """The sweep in words, naming the budget of every claim: resolved differences where the cap binds for
    both sides, the budgets where it binds for one side only, and the envelope."""
    reference = baseline().name
    capped = [r for r in recipes if r["head_budget_tau"] is not None]
    muon_binds = {(r["arch"], r["head_budget_tau"]): bool(r["cap_binds"]) for r in capped if r["recipe"] == reference}
    both: list[str] = []
    one_side: dict[str, list[str]] = {}  # "`binding` at tau (arch)" -> the recipes it binds against
    for r in (r for r in capped if r["recipe"] != reference and r["diff_vs_muon"] is not None):
        other = muon_binds.get((r["arch"], r["head_budget_tau"]), False)
        where = f"at budget {num(r['head_budget_tau'])} ({r['arch']})"
        if r["cap_binds"] and other and _resolved(r):
            verb = "beats" if r["diff_vs_muon"] < 0 else "loses to"
            both.append(f"{where}, `{r['recipe']}` {verb} `{reference}` by "
                        f"{interval(abs(r['diff_vs_muon']), *_abs_interval(r))} nats")  # fmt: skip
        elif bool(r["cap_binds"]) != other:
            binding, free = (r["recipe"], reference) if r["cap_binds"] else (reference, r["recipe"])
            one_side.setdefault(f"`{binding}` {where}", []).append(f"`{free}`")
    lines = ["- Where the cap binds for both sides: " + ("; ".join(both) + "." if both else
             f"no recipe is resolved from `{reference}` at any budget with these seeds.")]  # fmt: skip
    if one_side:
        lines.append("- The cap binds for one side only (the comparison then mixes step size and direction): "
                     + "; ".join(f"{side}, not {', '.join(free)}" for side, free in one_side.items()) + ".")
    lines += [line for arch in sorted({r["arch"] for r in envelope}) if (line := _envelope_sentence(envelope, arch))]
    return "\n".join(lines) + "\n"


def _envelope_sentence(envelope: list[Row], arch: str) -> str | None:
    """The envelope in words: muon at its best budget, and each recipe resolved from it at its own."""
    reference = baseline().name
    rows = [r for r in envelope if r["arch"] == arch and r["recipe"] != reference and r["diff_vs_muon"] is not None]
    muon = next((r for r in envelope if r["arch"] == arch and r["recipe"] == reference), None)
    if not (muon and rows):
        return None
    resolved = [f"`{r['recipe']}` at budget {num(r['best_tau'])} {'lower' if r['diff_vs_muon'] < 0 else 'higher'} "
                f"by {interval(abs(r['diff_vs_muon']), *_abs_interval(r))}" for r in rows if _resolved(r)]  # fmt: skip
    return (f"- Envelope ({arch}, each recipe at its best budget on val; `{reference}` at {num(muon['best_tau'])}, "
            f"test loss {num(muon['test_loss_mean'], 4)}): "
            + ("; ".join(resolved) if resolved else f"no recipe resolved from `{reference}`") + ".")  # fmt: skip


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
        text = ", ".join(f"seeds {', '.join(map(str, ran))} for " + (" and ".join(who) if len(who) <= 2 else
                                                                      f"{len(who)} recipes")
                         for ran, who in sorted(groups.items(), key=lambda g: -len(g[1])))  # fmt: skip
        described.setdefault(text, []).append(arch)
    return "; ".join(f"{', '.join(sorted(archs))}: {text}" for text, archs in described.items())


def _protocol(runs: list[Row], recipes: list[Row], tuning: dict[str, Any] | None) -> str:
    """What an optimizer researcher needs to trust the comparison (SPEC §3.2)."""
    lines = [
        "### Protocol\n",
        ("- **Splits.** Train, val and test are split by document. Tuning and the curves use val; recipes are "
         "compared on test, read once per run after its last step (no tuning run reads it)."),
        (f"- **Seeds.** {_seeds_statement(runs)}. A seed fixes the initialisation and the batch order, so "
         "differences are paired on the seeds both runs have. Only the head's optimizer differs (`adamw`: every "
         "matrix); all recipes run the same steps and tokens."),
        _power_statement(recipes),
        _tuning_statement(tuning, runs),
        ("- **Step size vs direction.** Recipes take their own tuned step sizes, so their steps differ in size as "
         "well as direction (`hilbert_bound` below); the matched-budget sweep at the end of this section "
         "compares them at equal worst-case nats per step, budget by budget."),
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
        detectable = median([r["detectable_diff"] for r in paired])
        parts.append(
            f"{arch}: seed SD of the test loss {num(seed_sd, 2)} nats, of the paired difference {num(paired_sd, 2)}; "
            f"{min(r['n_paired'] for r in paired)} paired seeds detect {num(detectable, 2)} nats (power {POWER:g}, "
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
    diverged = [f"`{r['run']}` (step {num(r['diverged_at_step'])})" for r in runs if r["diverged"]]
    unfinished = [f"`{r['run']}`" for r in runs if not r["finished"]]
    parts = [f"diverged (left out of the means): {', '.join(diverged)}" if diverged else "no run diverged"]
    if unfinished:
        parts.append(f"stopped before a final `run.json` (logged steps only): {', '.join(unfinished)}")
    return "- **Runs.** " + "; ".join(parts) + "."


GEOMETRY_COLUMNS = ("median_hilbert_bound", "median_hilbert_realized_train", "median_head_alignment",
                    "median_head_alignment_hilbert", "median_equi_ratio", "median_equi_ratio_random")  # fmt: skip


def _geometry_table(runs: list[Row]) -> str:
    """Per arch × recipe, medians over runs of each run's median over logged steps."""
    rows = [[arch, f"`{recipe}`", *(median([r[c] for r in rs]) for c in GEOMETRY_COLUMNS)]
            for (arch, recipe), rs in _by_arch_recipe(runs).items()]  # fmt: skip
    header = ["arch", "recipe", "hilbert_bound (nats)", "d_H on its batch", "cos(ΔW, −G)", "descent / hilbert's",
              "equi_ratio", "random rows"]  # fmt: skip
    equi_bound = num(median([r["median_equi_ratio_bound"] for r in runs]))
    note = ("Medians over logged steps, then seeds. *d_H on its batch*: the largest change of a token's "
            "log-probability the head step made on the batch it was computed from; *descent / hilbert's*: −⟨G, ΔW⟩ "
            "per unit diameter relative to the `hilbert` step (SPEC §3.3); *equi_ratio*: min/max row distance of ΔW "
            f"on a fixed row sample, against random unit rows (no configuration exceeds {equi_bound}).\n")  # fmt: skip
    return markdown_table(header, rows) + "\n" + note


_HOLDS = {True: "holds", False: "does not hold", None: "not measured"}


def _study_b_claims(claims: list[Row]) -> str:
    """The bound and the equidistance claims in words (the comparison with muon is in the summary)."""
    rows = [c for c in claims if c["study"] == "B" and c["claim"] != "beats_muon"]
    plain = [f"- `hilbert_equi`'s update rows are **not measurably more equidistant than random unit rows** "
             f"({c['subject']}): the interval of the difference includes 0 or lies below it.\n"
             for c in rows if c["claim"] == "equi_spreads_rows" and c["holds"] is False]  # fmt: skip
    stated = [f"- `{c['claim']}` ({c['subject']}): **{_HOLDS[c['holds']]}**: {c['detail']}.\n" for c in rows]
    return "".join(stated + plain)


def appendix(tables: Tables, step_times: dict[str, float]) -> str:
    """The per-run table; `step_times` (run → median wall-clock seconds per step, from the stage's telemetry,
    never a result) where measured."""
    runs = runs_of_kind(tables["runs"])
    if not runs:
        return ""
    rows = [[f"`{r['run']}`", r["head_step"] or "–", num(r["final_test_loss"], 4), num(r["final_val_loss"], 4),
             num(step_times.get(r["run"])), num(r["median_hilbert_bound"]), num(r["max_tightness"]),
             "sampled (lower bound)" if r["head_diam_sampled"] else "exact"] for r in runs]  # fmt: skip
    header = ["run", "head step", "test loss", "val loss", "step time (s)", "hilbert_bound", "max tightness",
              "diameter"]  # fmt: skip
    sweep = len(runs_of_kind(tables["runs"], True))
    query = '`lmgeo query "SELECT * FROM runs WHERE matched"`'
    more = f"\nThe matched-budget sweep's {sweep} runs: {query}.\n" if sweep else ""
    return "## Appendix: per run\n\n" + markdown_table(header, rows) + more
