"""End to end: `dvc repro` on the tiny preset in a fresh git repo, then a param change, versioned
queries across both commits and `dvc metrics diff`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from study_helpers import REPO, commit, new_study, sh, write_params

from lmgeo.core.config import flatten_overrides, load_yaml
from lmgeo.params import apply_overrides, load_params
from lmgeo.results.headline import HEADLINE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    return new_study(tmp_path_factory.mktemp("study"))


def test_repro_query_and_metrics_diff(study: Path):
    # The README's command for a preset, as written: the tiny study as an experiment, applied to the workspace.
    readme = (study / "README.md").read_text()
    sh("lmgeo", "exp", "run", "presets/tiny.yaml", cwd=study)
    assert (study / "README.md").read_text() == readme  # an experiment rewrites no tracked document
    assert load_params(study / "params.yaml") == apply_overrides(
        load_params(REPO / "params.yaml"), flatten_overrides(load_yaml(REPO / "presets" / "tiny.yaml"))
    )
    for produced in (
        "reports/report.md",
        "reports/report.html",
        "reports/metrics.json",
        "reports/tables/runs.parquet",
        "reports/figures/study_b_val_loss.png",
        "data/train",
        "data/fits",
        "data/perturb",
    ):
        assert (study / produced).exists(), produced
    report = (study / "reports" / "report.md").read_text()
    for section in ("## Summary", "## Study B", "## Study A", "## Provenance"):
        assert section in report
    # The result tables are git's (not ignored, so the commit below holds them), and dvc.lock records them.
    assert sh("git", "check-ignore", "-q", "reports/tables/runs.parquet", cwd=study, check=False).returncode == 1
    assert sh("git", "check-ignore", "-q", "data/fits", cwd=study, check=False).returncode == 0
    lock = yaml.safe_load((study / "dvc.lock").read_text())["stages"]["aggregate"]["outs"]
    assert any(out["path"] == "reports/tables" and out["md5"].endswith(".dir") for out in lock), lock
    commit(study, "tiny study, run")
    assert "reports/tables/runs.parquet" in sh("git", "ls-files", "reports/tables", cwd=study).stdout

    again = sh("dvc", "repro", cwd=study)  # nothing changed: nothing runs, and DVC says so
    assert re.findall(r"Running stage '(\w+)'", again.stdout) == [], again.stdout
    assert "Data and pipelines are up to date." in again.stdout and "dvc push" not in again.stdout, again.stdout

    k_before = load_params(study / "params.yaml").analysis.k
    write_params(study, {"analysis.k": str(k_before - 2)})
    rerun = sh("dvc", "repro", cwd=study)
    assert "Running stage 'fit'" in rerun.stdout and "Running stage 'train'" not in rerun.stdout
    commit(study, "smaller k")

    rows = json.loads(
        sh(
            "lmgeo",
            "query",
            "SELECT rev, count(*) AS n FROM geometry GROUP BY rev ORDER BY rev",
            "--rev",
            "HEAD~1",
            "--rev",
            "HEAD",
            "--format",
            "json",
            cwd=study,
        ).stdout
    )
    assert {r["rev"] for r in rows} == {"HEAD~1", "HEAD"} and all(r["n"] > 0 for r in rows)
    ks = json.loads(
        sh(
            "lmgeo",
            "query",
            "SELECT DISTINCT rev, k FROM fits ORDER BY rev",
            "--rev",
            "HEAD~1",
            "--rev",
            "HEAD",
            "--format",
            "json",
            cwd=study,
        ).stdout
    )
    assert {(r["rev"], r["k"]) for r in ks} == {("HEAD~1", k_before), ("HEAD", k_before - 2)}

    # The headline across the two revisions (`--all`: the tiny study's Study A verdicts need not move with k)
    diff = sh("dvc", "metrics", "diff", "HEAD~1", "HEAD", "--all", "--json", cwd=study).stdout
    compared = json.loads(diff)["reports/metrics.json"]
    assert set(HEADLINE.values()) & compared.keys(), diff[:2000]  # Study A's headline, at both revisions
    assert all({"old", "new"} <= v.keys() for v in compared.values()), diff[:2000]


def test_dvc_shows_the_experiments_metrics_and_params_and_draws_the_data_plots_as_the_readme_says(study: Path):
    """docs/experiments.md's `dvc exp show` line in a 200-column terminal after an experiment (`--temp`: the
    working tree is left as it is): the params and metrics that differ, no column of a path's hash;
    `dvc plots show`: the loss curves and the budget sweep as data series (a line per recipe), every figure of
    the report once."""
    k = load_params(study / "params.yaml").analysis.k
    sh("dvc", "exp", "run", "--temp", "-n", "smaller-k", "-S", f"analysis.k={k - 4}", cwd=study)
    (line,) = [c for c in readme_commands("dvc exp show", "docs/experiments.md") if "--only-changed" in c]
    shown = sh("sh", "-c", f"{line} --no-pager", cwd=study, env={"COLUMNS": "200"}).stdout.splitlines()
    header = next(row for row in shown if "Experiment" in row).split()
    # Exactly the params and the metrics that differ between the commit and the experiment (as DVC compares
    # them), and no column of a data or code path's hash.
    diff = json.loads(sh("dvc", "metrics", "diff", "HEAD", "smaller-k", "--json", cwd=study).stdout)
    changed = set(diff.get("reports/metrics.json", {}))
    assert set(header) == {"Experiment", "Created", "analysis.k", *changed}, (header, changed)
    assert all(len(row) <= 200 for row in shown), "\n".join(shown)
    assert any(re.search(rf"\s{k - 4}\s*$", row) for row in shown), shown

    plots = json.loads(sh("dvc", "plots", "show", "--json", cwd=study).stdout)["data"]
    for series, x in (("val_loss", "step"), ("loss_vs_budget", "head_budget_tau")):
        (drawn,) = plots[f"reports/plots/{series}.csv"]
        values = drawn["content"]["data"]["values"]
        assert drawn["type"] == "vega" and {v["recipe"] for v in values} == {"adamw", "hilbert"}, series
        assert {x, "arch"} <= values[0].keys(), values[0]
    images = sorted(name for name, drawn in plots.items() if drawn and drawn[0]["type"] == "image")
    wide = sorted(
        f"reports/figures/{p.name}" for p in (study / "reports" / "figures").glob("*.png") if ".narrow." not in p.name
    )
    assert images == wide, (images, wide)  # each figure once, every figure the report drew


def test_editing_a_stages_code_recomputes_its_shards_and_only_its(study: Path):
    """The code version of a shard covers the glue in `stages/` as well as the library: after an edit of
    `lmgeo/stages/fit.py` DVC reruns fit and every fit shard is recomputed (none skipped as complete), while a
    comment in the report's code reruns the report alone."""
    sh("dvc", "repro", cwd=study)
    fit = study / "lmgeo" / "stages" / "fit.py"
    fit.write_text(fit.read_text().replace("    return planned\n", "    return list(planned)\n", 1))
    rerun = sh("dvc", "repro", cwd=study)
    assert "Running stage 'fit'" in rerun.stdout and "Running stage 'extract'" not in rerun.stdout, rerun.stdout
    assert re.search(r"fit: 0/(\d+) shards complete, \1 to do", rerun.stdout), rerun.stdout
    report = study / "lmgeo" / "results" / "report.py"
    report.write_text(report.read_text() + "\n# a comment\n")
    last = sh("dvc", "repro", cwd=study)
    assert "Running stage 'report'" in last.stdout, last.stdout
    assert re.findall(r"Running stage '(\w+)'", last.stdout) == ["report"], last.stdout


def readme_commands(prefix: str, *pages: str) -> list[str]:
    """The shell lines starting with `prefix` of the README and of the docs `pages` named, as written (a trailing
    `# comment` dropped)."""
    text = "\n".join((REPO / page).read_text() for page in ("README.md", *pages))
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(prefix)]


def test_the_readmes_query_examples_run_as_written(study: Path):
    """Every `lmgeo query` line of the README and docs/query.md on the tiny study's two commits (HEAD~1, HEAD)."""
    examples = readme_commands("lmgeo query", "docs/query.md")
    assert len(examples) >= 4, examples
    for line in examples:
        done = sh("sh", "-c", line, cwd=study)
        assert done.stdout.strip(), line


def test_every_preset_is_accepted_by_dvc_as_the_readme_queues_it(study: Path):
    """`lmgeo exp run presets/<name>.yaml --queue` for every preset: DVC applies the overrides when it queues,
    so a key DVC cannot override fails here (nothing is run)."""
    presets = sorted((REPO / "presets").glob("*.yaml"))
    assert any(p.name == "gpu.yaml" for p in presets)
    try:
        for preset in presets:
            sh("lmgeo", "exp", "run", f"presets/{preset.name}", "--queue", cwd=study)
        queued = sh("dvc", "queue", "status", cwd=study).stdout
        assert queued.count("Queued") == len(presets), queued
    finally:
        sh("dvc", "queue", "remove", "--all", cwd=study, check=False)
