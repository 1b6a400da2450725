"""`lmgeo findings --write` (issue #58): it writes the findings escaped, into the one findings block whose
markers stand alone on their lines, leaves prose that quotes the markers as it is, and refuses a README that
has no such block, several, or is a symlink, leaving it as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import Result
from test_exp import workspace_with_report
from typer.testing import CliRunner

from lmgeo import cli
from lmgeo.params import default_study
from lmgeo.results.report import FINDINGS_END, FINDINGS_START, findings_in
from lmgeo.stages.report import RESULT_SECTIONS

HOSTILE = f'Study A <script>alert("x")</script> & <b>bold</b>. {FINDINGS_END} <img src=x onerror=alert(1)> escaped'
PROSE = f"Quoting the markers in prose: `{FINDINGS_START}` … `{FINDINGS_END}` starts and ends the block."


def readme_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finding: str = "Study A finds X.") -> Path:
    readme = workspace_with_report(tmp_path, default_study().section_hash(*RESULT_SECTIONS), finding)
    monkeypatch.chdir(tmp_path)
    return readme


def write() -> Result:
    return CliRunner().invoke(cli.app, ["findings", "--write", "README.md"])


def refused_with(done: Result, message: str) -> None:
    assert done.exit_code == 2, done.output
    assert done.stderr.strip().splitlines() == [f"lmgeo: error: {message}"]


def not_one_block(readme: str = "README.md") -> str:
    return (
        f"{readme}: not exactly one findings block (a line `{FINDINGS_START}`, then a line `{FINDINGS_END}`, each "
        f"marker alone on its line); fix it by hand and re-run `lmgeo findings --write {readme}`"
    )


def test_html_script_and_an_end_marker_in_the_findings_are_written_escaped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = readme_in(tmp_path, monkeypatch, HOSTILE)
    done = write()
    assert done.exit_code == 0, done.output
    escaped = (
        'Study A &lt;script&gt;alert("x")&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;. &lt;!-- findings:end --&gt; '
        "&lt;img src=x onerror=alert(1)&gt; escaped"
    )
    assert readme.read_text() == f"# lmgeo\n\nWhat it finds:\n\n{FINDINGS_START}\n{escaped}\n{FINDINGS_END}\n\nMore.\n"
    assert findings_in(readme.read_text()) == HOSTILE  # read back as the report states it
    again = write()
    assert again.exit_code == 0 and "unchanged" in again.stdout, again.output


def test_prose_quoting_the_markers_is_left_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = readme_in(tmp_path, monkeypatch)
    readme.write_text(f"# lmgeo\n\n{PROSE}\n\n{FINDINGS_START}\nold findings\n{FINDINGS_END}\n\n{PROSE}\n")
    done = write()
    assert done.exit_code == 0, done.output
    assert readme.read_text() == (
        f"# lmgeo\n\n{PROSE}\n\n{FINDINGS_START}\nStudy A finds X.\n{FINDINGS_END}\n\n{PROSE}\n"
    )


@pytest.mark.parametrize(
    "text",
    [
        f"# two blocks\n\n{FINDINGS_START}\na\n{FINDINGS_END}\n\n{FINDINGS_START}\nb\n{FINDINGS_END}\n",
        f"# only quoted\n\n{PROSE}\n",
        f"# reversed\n\n{FINDINGS_END}\nold findings\n{FINDINGS_START}\n",
        f"# a start marker without its end\n\n{FINDINGS_START}\nold findings\n",
    ],
    ids=["two blocks", "markers only quoted in prose", "end before start", "no end marker"],
)
def test_a_readme_without_exactly_one_block_is_refused_and_left_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    readme = readme_in(tmp_path, monkeypatch)
    readme.write_text(text)
    refused_with(write(), not_one_block())
    assert readme.read_text() == text


def test_a_symlinked_readme_is_refused_and_the_link_and_its_target_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = readme_in(tmp_path, monkeypatch)
    target = tmp_path / "elsewhere.md"
    readme.rename(target)
    before = target.read_text()
    readme.symlink_to(target)
    refused_with(
        write(),
        f"README.md: a symlink (to {target}), not the README file; replace the link with the file itself and "
        "re-run `lmgeo findings --write README.md`",
    )
    assert readme.is_symlink() and readme.readlink() == target and target.read_text() == before
