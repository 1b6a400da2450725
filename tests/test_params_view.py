"""The `params` view of `lmgeo query` (issue #58) says which params the result tables were computed with: every
row carries the params' own hash (`params_hash`) and the one the report's provenance records (`computed_with`),
and a query of the view warns where they differ, rather than joining tables with params they do not come from."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from lmgeo.driver.layout import PROVENANCE, Layout
from lmgeo.params import RESULT_SECTIONS, load_params
from lmgeo.results.query import query_table

REPO = Path(__file__).resolve().parents[1]
SOURCES = Layout(Path.cwd()).query_sources()
SQL = "SELECT DISTINCT params_hash, computed_with FROM params"


def workspace(tmp_path: Path, params: str, recorded: str | None) -> Path:
    (tmp_path / "params.yaml").write_text(params)
    if recorded is not None:
        (tmp_path / "reports").mkdir()
        (tmp_path / "reports" / PROVENANCE).write_text(json.dumps({"params_hash": recorded}))
    return tmp_path


def hashes(root: Path) -> list[tuple[str | None, str | None]]:
    table = query_table(SQL, None, root, SOURCES)
    return list(zip(table["params_hash"].to_pylist(), table["computed_with"].to_pylist(), strict=True))


def test_params_the_tables_were_computed_with_carry_both_hashes_equal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    current = load_params(REPO / "params.yaml").section_hash(*RESULT_SECTIONS)
    root = workspace(tmp_path, (REPO / "params.yaml").read_text(), current)
    with caplog.at_level(logging.WARNING, logger="lmgeo"):
        assert hashes(root) == [(current, current)]
    assert caplog.records == []
    assert query_table("SELECT count(*) AS n FROM params", None, root, SOURCES)["n"][0].as_py() > 0


def test_params_other_than_the_tables_were_computed_with_are_flagged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    current = load_params(REPO / "params.yaml").section_hash(*RESULT_SECTIONS)
    root = workspace(tmp_path, (REPO / "params.yaml").read_text(), "0" * 16)
    with caplog.at_level(logging.WARNING, logger="lmgeo"):
        assert hashes(root) == [(current, "0" * 16)]
    assert [r.getMessage() for r in caplog.records] == [
        f"{root}: params.yaml has params hash {current}, but the result tables were computed with {'0' * 16} "
        "(its `computed_with` column): `dvc repro` recomputes them with these params"
    ]


def test_params_this_code_cannot_load_and_no_provenance_give_null_hashes(tmp_path: Path) -> None:
    root = workspace(tmp_path, "analysis:\n  no_such_knob: 1\n", None)
    assert hashes(root) == [(None, None)]
    rows = query_table("SELECT key, value FROM params", None, root, SOURCES)
    assert rows.to_pylist() == [{"key": "analysis.no_such_knob", "value": "1"}]
