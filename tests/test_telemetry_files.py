"""`telemetry/train/`: stale times removed only where lmgeo wrote them; a symlinked folder refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmgeo.core.errors import InputError
from lmgeo.driver.layout import Layout
from lmgeo.driver.telemetry import RunTimes, write_telemetry


def test_only_telemetry_files_it_wrote_are_deleted(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    write_telemetry(layout, {"a", "b"}, {"a": RunTimes(1.0, [0.5]), "b": RunTimes(2.0, [1.0])})
    folder = layout.telemetry / "train"
    (folder / "notes.json").write_text('{"mine": true}\n')
    (folder / "broken.json").write_text("not json")
    write_telemetry(layout, {"a"}, {})
    assert sorted(p.name for p in folder.iterdir()) == ["a.json", "broken.json", "notes.json"]


def test_a_symlinked_telemetry_folder_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.json").write_text('{"run": "keep"}\n')
    workspace = tmp_path / "ws"
    workspace.mkdir()
    layout = Layout(workspace)
    layout.telemetry.mkdir(parents=True)
    (layout.telemetry / "train").symlink_to(elsewhere)
    with pytest.raises(InputError, match=r"train is a symlink \(to .*elsewhere\): lmgeo writes only inside"):
        write_telemetry(layout, set(), {"a": RunTimes(1.0, [0.5])})
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.json"]
