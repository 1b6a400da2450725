"""The report: ``report.md``, its figures, and ``report.html`` (the same content, self-contained), from the
result tables of ``lmgeo.results.aggregate`` (SPEC §2, §3.3, §4.4).

``render_report(tables_dir, out_md, figures_dir, provenance, tuning)`` leads with the answer: a summary (the
findings in a few sentences; the paper's claims in words per architecture, the claims × layers heat map under them
and the table of tests; the head-optimizer comparison with `muon` in words, its forest plot beside the budget
sweep and its table), then
Study B (protocol, step geometry, figures), Study A (one row per distinct model, claims per layer), an
appendix (the per-run table; where a table is too long it names the `lmgeo query` that selects it) and the
provenance last. A study whose tables are empty is reported as not run. The provenance and the record of the
head step-size tuning (`docs/tuning.json`) are gathered by the caller (`lmgeo.stages.report`). Each study's parts
are in `lmgeo.results.study_a.report` and `lmgeo.results.study_b.report`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from lmgeo.core.contracts import RESULT_TABLES, read_result_tables
from lmgeo.core.paths import contained, writable
from lmgeo.core.store import atomic_write
from lmgeo.results.common import NARROW, Figures, Tables, markdown_table
from lmgeo.results.headline import metric_meaning, metrics
from lmgeo.results.html import heading_anchor, to_html
from lmgeo.results.study_a import report as study_a
from lmgeo.results.study_a.claims import ClaimSummary, summarise
from lmgeo.results.study_b import report as study_b
from lmgeo.results.study_b.record import SweepRecord
from lmgeo.study_b.baseline import baseline

if TYPE_CHECKING:
    from lmgeo.params import Params


@dataclass(frozen=True)
class Rendered:
    """What was written: the report's line count, and per figure the labels of its panels as drawn
    (`common.axis_labels`), for the caller to print and the tests to check; `narrow`: the same for the
    one-column variants of multi-column figures; `findings`: what the study finds in a few sentences;
    `text_px`: per figure, its smallest text's height in the saved image's pixels (a browser scales it)."""

    lines: int
    figures: dict[str, list[dict[str, Any]]]
    narrow: dict[str, list[dict[str, Any]]]
    findings: str  # the summary's first paragraph, for README's findings block
    text_px: dict[str, float]


def render_report(
    tables_dir: Path,
    out_md: Path,
    figures_dir: Path,
    provenance: dict[str, Any],
    tuning: dict[str, Any] | None = None,
    step_times: dict[str, float] | None = None,
    sweep: SweepRecord | None = None,
    locality: Sequence[dict[str, Any]] = (),
    knob_records: Sequence[study_b.KnobRecord] = (),
    params: Params | None = None,
) -> Rendered:
    """Write ``out_md``, ``out_md`` with suffix ``.html`` and the figures (module docstring); `step_times`
    (run → median seconds per step) is telemetry, shown where given; `sweep`, the committed record of the
    matched-budget sweep, is what Study B cites when the study does not run the sweep itself; `locality`, the
    committed claim tests of the locality sweep (`study_a.report.read_locality_sweep`), is cited where given;
    `knob_records`, knobs tuned alone beside `tuning` (path, record), are stated where `tuning` lacks them;
    `params`, the study's, say what was run (the summary's first line; left out without them)."""
    found = read_result_tables(tables_dir) if tables_dir.is_dir() else {}
    tables = {name: found[name].to_pylist() if name in found else [] for name in RESULT_TABLES}
    link_prefix = Path(os.path.relpath(writable(figures_dir), out_md.parent))
    stale = previous_figures(writable(out_md), figures_dir, link_prefix)
    figures_dir.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.unlink(missing_ok=True)
    figures = Figures(figures_dir, link_prefix)
    claims = summarise(tables["claim_tests"])
    sweep_tables = study_b.sweep_source(tables, sweep)
    sections = [
        _summary(tables, claims, figures, sweep_tables, params),
        study_b.section(tables, figures, tuning, sweep_tables, knob_records),
        study_a.section(tables, claims, figures, locality),
        study_b.appendix(tables, step_times or {}),
        _headline_metrics(tables),
        _provenance(provenance),
    ]
    title = "# lmgeo report\n"
    text = "\n".join([title, _contents(title, sections), *sections])
    atomic_write(out_md, text)
    atomic_write(out_md.with_suffix(".html"), to_html(text, out_md.parent, title="lmgeo report"))
    return Rendered(text.count("\n"), figures.labels, figures.narrow_labels, findings(tables, claims), figures.text_px)


_IMAGE_LINK = re.compile(r"\]\(([^()\s]+)\.png\)")


def previous_figures(out_md: Path, figures_dir: Path, link_prefix: Path) -> list[Path]:
    """The figures the report at `out_md` shows (its image links under `link_prefix`): the only files of
    `figures_dir` a new report may delete, since the last one wrote them; each inside `figures_dir`."""
    text = out_md.read_text(errors="replace") if out_md.is_file() else ""
    shown = [PurePosixPath(link) for link in _IMAGE_LINK.findall(text)]
    stems = {link.name for link in shown if link.parent == PurePosixPath(link_prefix.as_posix())}
    names = sorted(f"{stem}{variant}.png" for stem in stems for variant in ("", NARROW))  # narrow: the HTML's
    return [contained(figures_dir, name) for name in names]


def _contents(title: str, sections: list[str]) -> str:
    """One line of links to the sections' headings (`##`), by the anchors GitHub and `html.to_html` give
    them (counted over every heading, as both count repeats)."""
    taken: set[str] = set()
    links = []
    for line in "\n".join([title, *sections]).splitlines():
        level, _, heading = line.partition(" ")
        if heading and set(level) == {"#"}:
            anchor = heading_anchor(heading, taken)
            if level == "##":
                links.append(f"[{heading.strip()}](#{anchor})")
    return "**Contents:** " + " · ".join(links) + "\n"


# ----------------------------------------------------------------------------------------- summary
def _summary(
    tables: Tables, claims: list[ClaimSummary], figures: Figures, sweep: study_b.SweepTables, params: Params | None
) -> str:
    """The answer first: what was run in a line or two, the findings as a short list in plain words, then the
    findings' numbers, then per study its statements in words, its figure, and the numbers."""
    out = ["## Summary\n"]
    if params is not None and (ran := what_was_run(tables, claims, params)):
        out.append(f"**What was run.** {ran}\n")
    if found := findings(tables, claims):
        out.append(f"**In short.** {found}\n")
    if numbers := " ".join(s for s in (study_a.finding(claims), study_b.finding(_compared(tables))) if s):
        out.append(f"**The numbers.** {numbers}\n")
    out.append("### The paper's claims, per architecture (Study A)\n")
    out.append(
        study_a.claims_summary(claims, tables["geometry"], tables["claim_tests"], figures, tables["paper_values"])
    )
    out.append(f"### Head optimizers against `{baseline().name}` (Study B)\n")
    out.append(study_b.summary(tables, figures, sweep))
    return "\n".join(out)


def findings(tables: Tables, claims: list[ClaimSummary]) -> str:
    """What the study finds, in plain words and few numbers: a line, then a list item per finding (Study A's,
    then Study B's per architecture compared); the summary's "In short" and README's findings block
    (`with_findings`; `lmgeo.stages.report.IN_SHORT` reads the line and the list). Empty when nothing was
    measured."""
    items = [f"Study A: {clause}." for clause in study_a.meanings(claims)]
    items += [f"Study B ({arch}): {clause}." for arch, clause in study_b.meanings(_compared(tables))]
    return "\n".join(["What the two studies find:", *(f"- {item}" for item in items)]) if items else ""


def _compared(tables: Tables) -> list[dict[str, Any]]:
    return study_b.runs_of_kind(tables["recipes"])


NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def what_was_run(tables: Tables, claims: list[ClaimSummary], params: Params) -> str:
    """What was run, in a line or two: the models (families, blocks, width, vocabulary, corpus), then per study
    what it varied: Study B's head recipes and seeds (as its tables have them), Study A's architectures, their
    training (steps × batch), seeds, fit classes and k. From `params` and the tables; empty when neither study
    has results."""
    train, analysis, prepare = params.train, params.analysis, params.prepare
    muon = baseline().name
    compared = sorted({r["arch"] for r in _compared(tables) if r["recipe"] != muon})
    runs = study_b.runs_of_kind(tables["runs"])
    studied = sorted({c.subject.removesuffix("@final") for c in claims if c.subject.endswith("@final")})
    families = sorted({*compared, *studied})
    if not families and not claims:
        return ""
    tokenizer = prepare.tokenizer
    vocabulary = f"a {tokenizer.vocab_size:,}-token BPE" if tokenizer.kind == "bpe" else f"the `{tokenizer.kind}`"
    corpus = prepare.corpus.source.capitalize() if prepare.corpus.source == "shakespeare" else "its corpus"
    count = NUMBER_WORDS[len(families)] if len(families) < len(NUMBER_WORDS) else str(len(families))
    model = train.model
    out = []
    if families:
        out.append(
            f"{count.capitalize()} {model.n_layers}-block model{'s' if len(families) != 1 else ''} of width "
            f"{model.d_model} ({', '.join(f'`{f}`' for f in families)}), {vocabulary} vocabulary, trained on "
            f"{corpus} ({prepare.seq_len}-token sequences)."
        )

    def length(arch: str) -> str:
        other = train.other_archs if train.other_archs and arch not in train.archs else None
        return f"{(other or train).steps} steps × batch {(other or train).batch_size}"

    for arch in compared:
        recipes = [r["recipe"] for r in _compared(tables) if r["arch"] == arch]
        per_recipe = [{r["seed"] for r in runs if r["arch"] == arch and r["recipe"] == name} for name in recipes]
        seeds = sorted(set.intersection(*per_recipe)) if per_recipe else []  # the seeds every recipe ran
        out.append(
            f"Study B: `{arch}` for {length(arch)} with each of {len(recipes)} head optimizers "
            f"({', '.join(f'`{r}`' for r in recipes)}), seeds {_seeds(seeds)}."
        )
    if studied:
        chosen = analysis.runs
        recipes = (chosen.recipes if chosen else None) or train.recipes
        seeds = (chosen.seeds if chosen else None) or train.seeds
        by_length: dict[str, list[str]] = {}
        for arch in studied:
            by_length.setdefault(length(arch), []).append(f"`{arch}`")
        trained = " and ".join(f"{', '.join(archs)} ({steps})" for steps, archs in by_length.items())
        out.append(
            f"Study A: {' and '.join(f'`{r}`' for r in recipes)}-trained {trained}, seeds {_seeds(seeds)}; each "
            f"layer's update at {' and '.join(f'`{c}`' for c in analysis.checkpoints)} fitted on its "
            f"k = {analysis.k} nearest tokens by {len(analysis.classes)} map classes "
            f"({', '.join(f'`{c}`' for c in analysis.classes)})."
        )
    return " ".join(out)


def _seeds(seeds: Sequence[int]) -> str:
    """Seeds as a range where they are consecutive (`0–4`), else listed."""
    seeds = sorted(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


FINDINGS_START, FINDINGS_END = "<!-- findings:start -->", "<!-- findings:end -->"


def findings_block(readme: str) -> tuple[int, int] | None:
    """The line numbers of `readme`'s findings markers: one start marker, then one end marker, each alone on its
    line; None for no such block or several (which one to write would be a guess). Prose that quotes a marker
    within a line is no marker."""
    lines = readme.split("\n")
    starts = [i for i, line in enumerate(lines) if line == FINDINGS_START]
    ends = [i for i, line in enumerate(lines) if line == FINDINGS_END]
    return (starts[0], ends[0]) if len(starts) == len(ends) == 1 and starts[0] < ends[0] else None


def with_findings(readme: str, found: str) -> str:
    """`readme` with the text of its findings block replaced by `found`, escaped (`escape_findings`); unchanged
    without exactly one block (`findings_block`)."""
    block = findings_block(readme)
    if block is None:
        return readme
    lines = readme.split("\n")
    return "\n".join([*lines[: block[0] + 1], escape_findings(found), *lines[block[1] :]])


def findings_in(readme: str) -> str | None:
    """The text of `readme`'s findings block as it was given to `with_findings`; None without exactly one block."""
    block = findings_block(readme)
    if block is None:
        return None
    return unescape_findings("\n".join(readme.split("\n")[block[0] + 1 : block[1]]))


def escape_findings(text: str) -> str:
    """`text` as README's Markdown shows it and no more: its `&`, `<` and `>` as entities, so that no HTML in it
    renders or runs, and no marker in it (each starts with `<`) opens or closes a block."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def unescape_findings(text: str) -> str:
    """The inverse of `escape_findings` (`&amp;` last, so that an escaped entity comes back as written)."""
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def _headline_metrics(tables: Tables) -> str:
    """`reports/metrics.json`, the names `dvc metrics show` and `dvc exp show` print, each with what it is."""
    rows = [(f"`{name}`", f"{value:g}", metric_meaning(name)) for name, value in metrics(tables).items()]
    return (
        "## The headline as DVC shows it\n\n`dvc metrics show` and `dvc exp show` print these short names "
        "(`reports/metrics.json`; short, so that a row fits a 200-column terminal); the tables above hold "
        "the intervals and the detail. A verdict score is +1 supported, 0 inconclusive, −½ not supported, −1 "
        "contradicted, averaged over the paper's classes, then over the trained architectures (`@final`) and "
        "the external models.\n\n"
        + markdown_table(["name", "value", "what it is"], rows, "Each metric, its value and what it is")
        + "\n"
    )


# -------------------------------------------------------------------------------------- provenance
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
