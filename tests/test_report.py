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


# A sweep record as `lmgeo tune` writes it: `hilbert` was tuned to 0.8 nats (the study ran it there), `muon` to
# 0.03 (the study ran 0.02).
TUNING = {
    "protocol": {"arch": "gpt2", "steps": 20, "seeds": [1000, 1001], "grid": "the grid", "transfer": None},
    "chosen": {"hilbert": {"knob": "tau", "value": 0.8, "mean_val_loss": 3.0},
               "muon": {"knob": "head_lr", "value": 0.03, "mean_val_loss": 3.1}},
    "trials": [{"arch": "gpt2", "recipe": r, "knob": k, "value": v, "seed": 1000}
               for r, k in (("hilbert", "tau"), ("muon", "head_lr")) for v in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4)],
}  # fmt: skip


def render(tmp_path: Path, write_data, tuning: dict | None = None) -> tuple[str, Path]:  # noqa: ANN001
    write_data(tmp_path / "data")
    aggregate(sources(tmp_path / "data"), tmp_path / "reports", CFG, KEY)
    out = tmp_path / "reports" / "report.md"
    render_report(tmp_path / "reports" / "tables", out, tmp_path / "reports" / "figures", PROVENANCE, tuning)
    return out.read_text(), out


def linked_figures(text: str, out: Path) -> list[Path]:
    return [out.parent / link for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)]


def test_full_report_has_every_section_and_its_figures(tmp_path: Path) -> None:
    text, out = render(tmp_path, write_tiny_study)
    for heading in ("## Setup & provenance", "## Study B", "### Protocol", "### Test loss, and the paired difference",
                    "### Head step geometry", "## Study A", "### Spearman per layer", "### Init (random weights) vs final",
                    "### Transformers vs state-space models", "## Claims as measured here"):  # fmt: skip
        assert heading in text
    assert "`0123abc`" in text and "`feedbeef`" in text
    # test loss = val + 0.05: mean of 2.55, 2.65, 2.70 with its t-interval; paired Δ to muon's 3.05, 3.15, 3.35
    assert "| gpt2 | `hilbert` | tau=0.8 | 3 | 2.633 [2.505, 2.762] | -0.55 [-0.696, -0.404] | 0.0082 | 0.0082 |" in text
    assert "not tested (< 3 paired seeds)" in text
    assert "3 seeds (0, 1, 2) for every recipe" in text and "matched-budget ablation caps" in text
    assert "No record of the head step-size sweep" in text
    assert "`hilbert_equi`'s equi_ratio 0.6 against 0.55 for random unit rows (`hilbert` 0.4)" in text
    assert "**Diverged runs**: `gpt2-sign-s0` (non-finite loss at step 7)" in text
    assert "`gpt2-rownorm-s0`" in text.split("Runs without a final")[1]
    assert "| `gpt2-muon-s0@final` | lowrank | spearman_rel_err_kl | 1 | holds | does not hold |" in text
    assert "| gpt2 | hilbert | beats_muon | -0.55 | holds |" in text
    assert "| gpt2 | hilbert_equi | equi_spreads_rows | 1.09 | holds |" in text  # 0.6 / 0.55 random rows
    figures = linked_figures(text, out)
    names = {p.name for p in figures}
    assert names == {"final_test_loss.png", "loss_curves.png", "hilbert_bound.png", "tightness.png", "equi_ratio.png",
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


def test_the_protocol_states_the_tuning_budget_and_where_runs_left_it(tmp_path: Path) -> None:
    text, _ = render(tmp_path, write_study_b, TUNING)
    assert "chosen on `gpt2` with the same budget: 7 step sizes per recipe (the grid)" in text
    assert "seeds 1000, 1001 (not the study's) for 20 steps, as here" in text
    assert "Not at the tuned step here: `muon` (head_lr=0.02, tuned head_lr=0.03)." in text


def test_a_matched_budget_study_says_so(tmp_path: Path) -> None:
    text, _ = render(tmp_path, lambda data: write_study_b(data, head_budget_tau=0.8))
    assert "This study is the **matched-budget ablation**" in text and "tau = 0.8 nats" in text


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


@pytest.mark.parametrize("name", ["final_test_loss.png", "spearman_layers.png"])
def test_figures_are_rewritten_not_accumulated(tmp_path: Path, name: str) -> None:
    render(tmp_path, write_tiny_study)
    stale = tmp_path / "reports" / "figures" / "old_figure.png"
    stale.write_bytes(b"x")
    render_report(tmp_path / "reports" / "tables", tmp_path / "reports" / "report.md", tmp_path / "reports" / "figures", {})
    assert not stale.exists() and (tmp_path / "reports" / "figures" / name).is_file()
