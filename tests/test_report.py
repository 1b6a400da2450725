"""The Markdown report, its figures and provenance (pipeline/report.py)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import matplotlib.image as mpimg
import pytest
from test_aggregate import CFG, KEY, sources, write_study_b, write_tiny_study

from pipeline.params import Params
from pipeline.results.aggregate import aggregate
from pipeline.results.report import render_report
from stages.layout import Layout
from stages.report import collect_provenance

PROVENANCE = {"git": {"revision": "0123abc", "uncommitted_changes": False}, "params_hash": "feedbeef", "seeds": {"train": [0, 1]}}


def render(tmp_path: Path, write_data) -> tuple[str, Path]:  # noqa: ANN001
    write_data(tmp_path / "data")
    aggregate(sources(tmp_path / "data"), tmp_path / "reports", CFG, KEY)
    out = tmp_path / "reports" / "report.md"
    render_report(tmp_path / "reports" / "tables", out, tmp_path / "reports" / "figures", PROVENANCE)
    return out.read_text(), out


def linked_figures(text: str, out: Path) -> list[Path]:
    return [out.parent / link for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)]


def test_full_report_has_every_section_and_its_figures(tmp_path: Path) -> None:
    text, out = render(tmp_path, write_tiny_study)
    for heading in ("## Setup & provenance", "## Study B", "### Final validation loss", "### Head step in Hilbert units",
                    "## Study A", "### Spearman per layer", "### Init (random weights) vs final",
                    "### Transformers vs state-space models", "## Claims as measured here"):  # fmt: skip
        assert heading in text
    assert "`0123abc`" in text and "`feedbeef`" in text
    assert "| gpt2 | `hilbert` | 3 | 2.583 ± 0.076 |" in text  # mean ± std over seeds
    assert "not tested (< 3 seeds)" in text
    assert "**Diverged runs**: `gpt2-sign-s0` (non-finite loss at step 7)" in text
    assert "`gpt2-rownorm-s0`" in text.split("Runs without a final")[1]
    assert "| `gpt2-muon-s0@final` | lowrank | spearman_rel_err_kl | 1 | holds | does not hold |" in text
    assert "| gpt2 | hilbert | beats_muon | -0.55 | holds |" in text
    figures = linked_figures(text, out)
    names = {p.name for p in figures}
    assert names == {"final_val_loss.png", "loss_curves.png", "hilbert_bound.png", "tightness.png", "equi_ratio.png",
                     "angles.png", "spearman_layers.png"}  # fmt: skip
    for path in figures:
        image = mpimg.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image[..., :3].std() > 0.05  # something was drawn


def test_report_without_any_data_says_what_was_not_run(tmp_path: Path) -> None:
    text, out = render(tmp_path, lambda d: None)
    assert "Study B was not run" in text and "Study A was not run" in text
    assert "not measured (Study A not run)" in text and "Not measured: Study B was not run." in text
    assert linked_figures(text, out) == [] and not list((tmp_path / "reports" / "figures").glob("*.png"))


def test_report_with_study_b_only(tmp_path: Path) -> None:
    text, out = render(tmp_path, write_study_b)
    assert "Study A was not run" in text and "Study B was not run" not in text
    assert all(p.is_file() for p in linked_figures(text, out))


def test_provenance_in_a_git_checkout(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True)  # fmt: skip
        return done.stdout.strip()

    git("init", "-q")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  prepare:\n    outs:\n    - path: data/tokens\n      md5: abc.dir\n")
    git("add", "dvc.lock")
    git("commit", "-qm", "x")
    params = Params.model_validate({"train": {"seeds": [0, 1, 2]}})
    prov = collect_provenance(Layout(tmp_path), params)
    assert prov["git"] == {"revision": git("rev-parse", "HEAD"), "uncommitted_changes": False}
    assert prov["params_hash"] == params.section_hash("prepare", "train", "analysis", "report")
    assert prov["seeds"]["train"] == [0, 1, 2]
    assert prov["data_checksums"]["stage outputs (dvc.lock)"] == {"data/tokens": "md5:abc.dir"}
    assert prov["data_checksums"]["dvc.lock"].startswith("sha256:")
    assert {"python", "torch", "duckdb", "dvc"} <= set(prov["packages"])
    assert prov["hardware"]["logical_cores"] >= 1
    (tmp_path / "dvc.lock").write_text("changed")
    assert collect_provenance(Layout(tmp_path), params)["git"]["uncommitted_changes"] is True


def test_provenance_outside_git(tmp_path: Path) -> None:
    prov = collect_provenance(Layout(tmp_path), Params())
    assert prov["git"]["revision"].startswith("unknown") and prov["data_checksums"] == {}


@pytest.mark.parametrize("name", ["final_val_loss.png", "spearman_layers.png"])
def test_figures_are_rewritten_not_accumulated(tmp_path: Path, name: str) -> None:
    render(tmp_path, write_tiny_study)
    stale = tmp_path / "reports" / "figures" / "old_figure.png"
    stale.write_bytes(b"x")
    render_report(tmp_path / "reports" / "tables", tmp_path / "reports" / "report.md", tmp_path / "reports" / "figures", {})
    assert not stale.exists() and (tmp_path / "reports" / "figures" / name).is_file()
