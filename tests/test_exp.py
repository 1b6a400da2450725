"""Experiments never rewrite tracked documents: a preset runs through `lmgeo exp run PRESET` (checked before DVC
starts), and README's findings block is written only by `lmgeo findings --write README.md`, from a report of the
default study."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmgeo import cli
from lmgeo.params import default_study
from lmgeo.results.report import FINDINGS_END, FINDINGS_START, findings_in
from lmgeo.stages.report import RESULT_SECTIONS

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def execs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """What `lmgeo exp run` would exec, recorded instead (in a folder holding the default params.yaml)."""
    calls: list[list[str]] = []

    def record(path: str, argv: list[str]) -> None:
        calls.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", record)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "tiny.yaml").write_text((REPO / "presets" / "tiny.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    return calls


def test_exp_run_hands_the_presets_overrides_and_dvcs_own_options_to_dvc_exp_run(execs) -> None:
    done = CliRunner().invoke(cli.app, ["exp", "run", "presets/tiny.yaml", "--queue", "-n", "tiny"])
    assert done.exit_code == 0, done.output
    (argv,) = execs
    assert argv[:7] == [sys.executable, "-m", "dvc", "exp", "run", "--queue", "-n"] and argv[7] == "tiny"
    overrides = argv[8:]
    assert overrides[::2] == ["-S"] * (len(overrides) // 2)
    assert "train.steps=20" in overrides[1::2] and "analysis.k=40" in overrides[1::2]
    printed = CliRunner().invoke(cli.app, ["preset", "presets/tiny.yaml"]).stdout.split()
    assert printed == overrides  # the same options `lmgeo preset` prints


@pytest.mark.parametrize(
    ("preset", "content", "problem"),
    [("presets/tinyy.yaml", None, "file not found"), ("bad.yaml", "trainn: {steps: 3}\n", "unknown key 'trainn'")],
)
def test_a_missing_or_invalid_preset_is_one_error_line_and_starts_no_dvc(execs, preset, content, problem) -> None:
    if content is not None:
        Path(preset).write_text(content)
    done = CliRunner().invoke(cli.app, ["exp", "run", preset])
    assert done.exit_code == 2 and execs == [], done.output
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"lmgeo: error: {preset}: ") and problem in line, line


# ----------------------------------------------------------------------------------------- findings
def workspace_with_report(root: Path, params_hash: str, finding: str = "Study A finds X. Study B finds Y.") -> Path:
    (root / "reports").mkdir(parents=True)
    (root / "reports" / "report.md").write_text(f"# Report\n\n## Summary\n\n**In short.** {finding}\n\nMore.\n")
    (root / "reports" / "provenance.json").write_text(json.dumps({"params_hash": params_hash}))
    (root / "params.yaml").write_text((REPO / "params.yaml").read_text())
    readme = root / "README.md"
    readme.write_text(f"# lmgeo\n\nWhat it finds:\n\n{FINDINGS_START}\nold findings\n{FINDINGS_END}\n\nMore.\n")
    return readme


def test_findings_are_written_into_readme_only_by_the_command_and_only_from_the_default_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default_hash = default_study().section_hash(*RESULT_SECTIONS)
    readme = workspace_with_report(tmp_path, default_hash)
    monkeypatch.chdir(tmp_path)
    shown = CliRunner().invoke(cli.app, ["findings"])
    assert shown.exit_code == 0 and shown.stdout.strip() == "Study A finds X. Study B finds Y.", shown.output
    assert findings_in(readme.read_text()) == "old findings"  # printing writes nothing
    written = CliRunner().invoke(cli.app, ["findings", "--write", "README.md"])
    assert written.exit_code == 0, written.output
    text = readme.read_text()
    assert findings_in(text) == "Study A finds X. Study B finds Y." and text.endswith("\n\nMore.\n")
    # tests/test_committed_results.py's check holds for what the command wrote
    assert f"**In short.** {findings_in(text)}\n" in (tmp_path / "reports" / "report.md").read_text()

    experiment = tmp_path / "experiment"
    experiment.mkdir()
    readme = workspace_with_report(experiment, "hash-of-the-tiny-preset", "The tiny study finds Z.")
    monkeypatch.chdir(experiment)
    refused = CliRunner().invoke(cli.app, ["findings", "--write", "README.md"])
    assert refused.exit_code == 2 and findings_in(readme.read_text()) == "old findings", refused.output
    (line,) = refused.stderr.strip().splitlines()
    assert "not the default study's" in line and "`git checkout params.yaml`" in line, line


def test_the_readme_opens_with_its_purpose_and_puts_your_own_model_right_after_the_two_commands():
    """A newcomer reads what the project finds out and for whom first, then the two commands, then how to run it
    on their own model (issue #40)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert sections[:3] == ["Quick start", "The two commands", "Your own model"]
    opening = text[: text.index("## The two commands")].split("\n\n")[1]
    assert "tests whether the claims of two papers" in opening and "researchers" in opening
    assert "lmgeo analyse" in text[text.index("## Your own model") : text.index(f"## {sections[3]}")]
