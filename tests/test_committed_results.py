"""The committed results are what the committed code computes (SPEC §1): `reports/` and `dvc.lock` come from a
clean tree at a revision whose code and params are HEAD's. When this fails after a code or params change,
run `dvc repro` on the committed tree and commit its outputs."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from lmgeo.core.config import parse_yaml
from lmgeo.core.provenance import committed_results_problems, git_state
from lmgeo.driver.deps import result_inputs
from lmgeo.stages.report import PROVENANCE

REPO = Path(__file__).resolve().parents[1]


def in_git_checkout() -> bool:
    done = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], cwd=REPO, capture_output=True, text=True)
    return done.returncode == 0


@pytest.mark.skipif(not in_git_checkout(), reason="needs the project's git history")
def test_the_committed_report_names_a_clean_revision_with_heads_code_and_params() -> None:
    path = REPO / "reports" / PROVENANCE
    assert path.is_file(), f"no {path}: run `dvc repro` on the committed tree and commit its outputs"
    recorded = json.loads(path.read_text())["git"]
    assert committed_results_problems(REPO, recorded, result_inputs(REPO)) == []


def test_the_committed_lock_holds_the_current_code_and_params() -> None:
    """What `dvc status` would say of the code and params deps: every one that dvc.lock records is the file
    or value in the tree now."""
    # Read as lmgeo reads params (YAML 1.1 would take DVC's `1e-06` for a string).
    lock = parse_yaml((REPO / "dvc.lock").read_text())["stages"]
    params = parse_yaml((REPO / "params.yaml").read_text())
    stale = []
    for stage, entry in lock.items():
        for dep in entry.get("deps", []):
            path = REPO / dep["path"]
            if dep["path"].endswith(".py") and (
                not path.is_file() or hashlib.md5(path.read_bytes()).hexdigest() != dep["md5"]
            ):
                stale.append(f"{stage}: {dep['path']}")
        for key, value in entry.get("params", {}).get("params.yaml", {}).items():
            if _lookup(params, key) != value:
                stale.append(f"{stage}: params {key}")
    assert not stale, f"dvc.lock is stale ({', '.join(stale)}): run `dvc repro` and commit its outputs"


def _lookup(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


# ----------------------------------------------------------------------------------- the check itself
def git(workspace: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=workspace,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()


@pytest.fixture
def history(tmp_path: Path) -> Path:
    """A repo whose code and params are committed, then its outputs in a second commit."""
    git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "params.yaml").write_text("k: 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "code")
    return tmp_path


INPUTS = ["code.py", "params.yaml"]


def run_and_commit_outputs(workspace: Path) -> dict:
    recorded = git_state(workspace, INPUTS)
    (workspace / "report.md").write_text("results\n")  # what the run writes
    git(workspace, "add", "-A")
    git(workspace, "commit", "-qm", "outputs")
    return recorded


def test_results_of_a_clean_tree_committed_after_it_are_accepted(history: Path) -> None:
    recorded = run_and_commit_outputs(history)
    assert recorded["uncommitted_changes"] is False
    (history / "README.md").write_text("docs change nothing\n")
    git(history, "add", "-A")
    git(history, "commit", "-qm", "docs")
    assert committed_results_problems(history, recorded, INPUTS) == []


def test_results_written_with_uncommitted_code_are_refused(history: Path) -> None:
    (history / "code.py").write_text("x = 2\n")
    recorded = run_and_commit_outputs(history)
    assert committed_results_problems(history, recorded, INPUTS) == [
        f"the results were written with uncommitted code or params (at {recorded['revision']!r}); commit, then "
        "`dvc repro`"
    ]


def test_results_of_an_older_revision_are_refused_naming_what_changed(history: Path) -> None:
    recorded = run_and_commit_outputs(history)
    (history / "params.yaml").write_text("k: 2\n")
    git(history, "commit", "-qam", "params")
    problems = committed_results_problems(history, recorded, INPUTS)
    assert len(problems) == 1 and problems[0].startswith("params.yaml changed after the results' revision")


def test_results_of_a_revision_outside_the_history_are_refused(history: Path) -> None:
    recorded = {"revision": "0" * 40, "uncommitted_changes": False}
    assert "not HEAD or an ancestor" in committed_results_problems(history, recorded, INPUTS)[0]


def test_the_readmes_findings_are_the_committed_reports() -> None:
    """README's findings block is what `lmgeo findings --write README.md` wrote from the committed results (the
    first paragraph of the report's summary), so it cannot go stale."""
    from lmgeo.results.report import findings_in

    found = findings_in((REPO / "README.md").read_text())
    assert found, "README.md has no findings block (<!-- findings:start --> … <!-- findings:end -->)"
    report = (REPO / "reports" / "report.md").read_text()
    assert f"**In short.** {found}\n" in report, (
        "README's findings are stale: `dvc repro`, then `lmgeo findings --write README.md` and commit README.md"
    )
