"""A preset is applied as lmgeo validates it: what DVC would read otherwise (an interpolation, a scalar YAML 1.1
and 1.2 read differently) or cannot apply (a key that is no name, a mapping under a value, a list item) is one
error line, exit 2, for `lmgeo preset` and `lmgeo exp run` alike, DVC not started and params.yaml unchanged; a
change of a security setting needs `--allow-security-changes`, and is printed when given."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmgeo import cli
from lmgeo.core.config import MAX_YAML_DEPTH, ParamsError, parse_yaml
from lmgeo.params import Params, apply_overrides

REPO = Path(__file__).resolve().parents[1]
REFUSED_PATHS = [["preset", "p.yaml"], ["exp", "run", "p.yaml"]]


@pytest.fixture
def execs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """What `lmgeo exp run` would exec, recorded instead (in a folder holding the default params.yaml)."""
    calls: list[list[str]] = []

    def record(path: str, argv: list[str]) -> None:
        calls.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", record)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    return calls


def refused(args: list[str], preset: str, execs: list[list[str]]) -> str:
    """The one error line a refused preset gives; nothing started, params.yaml as it was."""
    Path("p.yaml").write_text(preset)
    done = CliRunner().invoke(cli.app, args)
    assert done.exit_code == 2 and execs == [] and done.stdout == "", done.output
    assert Path("params.yaml").read_text() == (REPO / "params.yaml").read_text()
    (line,) = done.stderr.splitlines()
    return line


@pytest.mark.parametrize("args", REFUSED_PATHS)
@pytest.mark.parametrize(
    ("preset", "key", "value"),
    [
        ('train: {device: "${oc.env:HOME}"}\n', "train.device", "${oc.env:HOME}"),
        ('train: {archs: [gpt2, "${oc.decode:1}"]}\n', "train.archs[1]", "${oc.decode:1}"),
        ('analysis: {runs: {archs: ["x${oc.select:a,b}"]}}\n', "analysis.runs.archs[0]", "x${oc.select:a,b}"),
    ],
)
def test_an_interpolation_in_a_preset_value_is_refused_naming_the_key(execs, args, preset, key, value) -> None:
    assert refused(args, preset, execs) == (
        f"lmgeo: error: p.yaml: {key}: {value!r} is an interpolation, which DVC would resolve: write the value itself"
    )


@pytest.mark.parametrize("args", REFUSED_PATHS)
def test_an_interpolation_in_a_preset_key_is_refused_naming_it(execs, args) -> None:
    line = refused(args, 'train: {"${oc.env:USER}": 1}\n', execs)
    assert line == (
        "lmgeo: error: p.yaml: train.${oc.env:USER}: '${oc.env:USER}' is an interpolation, which DVC would "
        "resolve: write the value itself"
    )


@pytest.mark.parametrize("args", REFUSED_PATHS)
def test_a_mapping_under_a_value_is_one_error_line(execs, args) -> None:
    line = refused(args, "train: {steps: {a: 1}}\n", execs)
    assert (
        line == "lmgeo: error: p.yaml: overrides: train.steps.a: train.steps is a value (800), not a section with keys"
    )


@pytest.mark.parametrize("args", REFUSED_PATHS)
@pytest.mark.parametrize(("preset", "key", "shown"), [("{0: gpt2}", "0", "0"), ('{"0": gpt2}', "0", "'0'")])
def test_a_list_addressed_by_index_in_a_preset_is_one_error_line(execs, args, preset, key, shown) -> None:
    line = refused(args, f"train: {{archs: {preset}}}\n", execs)
    assert line == f"lmgeo: error: p.yaml: train.archs.{key}: the key {shown} is not a name (letters, digits, _ and -)"


def test_a_list_addressed_by_index_in_overrides_is_an_input_error() -> None:
    with pytest.raises(ParamsError) as err:
        apply_overrides(Params(), {"train.archs.0": "gpt2"})
    assert (
        str(err.value) == "overrides: train.archs.0: train.archs is a list: give the whole list, not one item by index"
    )


@pytest.mark.parametrize("args", REFUSED_PATHS)
@pytest.mark.parametrize("preset", ["- train\n", "5\n", "", "just text\n"])
def test_a_preset_that_is_not_a_mapping_is_one_error_line(execs, args, preset) -> None:
    assert refused(args, preset, execs) == "lmgeo: error: p.yaml: a preset must be a mapping of params sections"


@pytest.mark.parametrize("args", REFUSED_PATHS)
def test_a_security_change_from_a_preset_needs_the_flag(execs, args) -> None:
    line = refused(args, "security: {trust_remote_code: true}\n", execs)
    assert line == (
        "lmgeo: error: p.yaml: changes security.trust_remote_code: False -> True: "
        "pass --allow-security-changes to apply it"
    )


def test_an_allowed_security_change_is_printed_and_handed_to_dvc(execs) -> None:
    Path("p.yaml").write_text("security: {allow_outside_paths: true}\n")
    done = CliRunner().invoke(cli.app, ["exp", "run", "p.yaml", "--allow-security-changes", "--temp"])
    assert done.exit_code == 0, done.output
    assert done.stderr == "lmgeo: warning: p.yaml changes security.allow_outside_paths: False -> True\n"
    assert execs == [[sys.executable, "-m", "dvc", "exp", "run", "--temp", "-S", "security.allow_outside_paths=true"]]
    printed = CliRunner().invoke(cli.app, ["preset", "p.yaml", "--allow-security-changes"])
    assert printed.exit_code == 0 and printed.stdout == "-S security.allow_outside_paths=true\n", printed.output


def test_a_security_setting_left_as_it_is_needs_no_flag(execs) -> None:
    Path("p.yaml").write_text("security: {trust_remote_code: false}\n")
    done = CliRunner().invoke(cli.app, ["preset", "p.yaml"])
    assert done.exit_code == 0 and done.stderr == "", done.output
    assert done.stdout == "-S security.trust_remote_code=false\n"


# ------------------------------------------------------------------------------------------ YAML
@pytest.mark.parametrize("args", REFUSED_PATHS)
def test_an_octal_looking_number_is_refused_not_read_as_yaml_1_1_octal(execs, args) -> None:
    line = refused(args, "train: {steps: 0100}\n", execs)
    assert line == (
        "lmgeo: error: p.yaml: not valid YAML: line 1, column 16: '0100' reads differently in YAML 1.1 and YAML 1.2 "
        "(as DVC reads it): quote it for text, or write the number (in decimal) or true/false it means"
    )


# YAML 1.1 and 1.2 read these alike or differently; ruamel (YAML 1.2) reads params as DVC does.
TRICKY = ["0100", "09", "-012", "0o17", "0b101", "0x1F", "1_000", "1:30", "1:30.5", "yes", "No", "on", "OFF", "y"]
TRICKY += ["1e3", "1.5e-3", ".5", "1.", "+12", "-0", "0", ".inf", "~", "null", "true", "False", "text", "'0100'"]


@pytest.mark.parametrize("scalar", TRICKY)
def test_every_scalar_lmgeo_reads_it_reads_as_dvc_does(scalar: str) -> None:
    ruamel = pytest.importorskip("ruamel.yaml")
    dvc = ruamel.YAML(typ="safe").load(f"a: {scalar}\n")
    try:
        ours = parse_yaml(f"a: {scalar}\n")
    except Exception as err:  # noqa: BLE001 - a refusal is the other allowed outcome
        assert "reads differently in YAML 1.1 and YAML 1.2" in str(err)
        return
    assert ours == dvc and type(ours["a"]) is type(dvc["a"])


def test_the_scalars_yaml_versions_read_differently_are_refused() -> None:
    for scalar in ["0100", "09", "0o17", "1:30", "yes", "on", "OFF"]:
        with pytest.raises(Exception, match="reads differently in YAML 1.1 and YAML 1.2"):
            parse_yaml(f"a: {scalar}\n")


@pytest.mark.parametrize("args", REFUSED_PATHS)
def test_deeply_nested_yaml_is_one_error_line(execs, args) -> None:
    depth = 100_000  # far beyond Python's recursion limit
    line = refused(args, "a: " + "[" * depth + "]" * depth + "\n", execs)
    column = 3 + MAX_YAML_DEPTH  # the document and `a:`'s mapping are the first two levels
    assert (
        line
        == f"lmgeo: error: p.yaml: not valid YAML: line 1, column {column}: nested deeper than {MAX_YAML_DEPTH} levels"
    )


def test_nesting_up_to_the_limit_is_read() -> None:
    depth = MAX_YAML_DEPTH - 1  # the top-level mapping is the first level
    innermost: list = []
    for _ in range(depth - 1):
        innermost = [innermost]
    assert parse_yaml("a: " + "[" * depth + "]" * depth) == {"a": innermost}
