"""Every path lmgeo writes, deletes or lists stays inside its workspace (issue #58): a symlink on the way out
is refused, naming it, before anything is touched; links DVC makes into the workspace's own cache
(`cache.type: symlink`) are read and replaced like copies, and nothing they point to is deleted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from lmgeo.core.paths import OutsidePath, in_dvc_cache
from lmgeo.core.store import (
    ManifestKey,
    ShardWriter,
    atomic_write,
    manifest_path,
    prune_shards,
    verified_files,
    write_plan,
)
from lmgeo.driver.layout import Layout
from lmgeo.results.report import previous_figures, render_report
from lmgeo.stages.report import report_inputs

KEY = ManifestKey({"activations": "a1"}, "p1", "c1")
TABLE = pa.table({"layer": [1, 2], "rel_err": [0.1, 0.2]})


def state(path: Path) -> tuple[int, bytes]:
    """A file's modification time and bytes: an untouched file keeps both."""
    return path.stat().st_mtime_ns, path.read_bytes()


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """A workspace (its `params.yaml` marks it) with a folder of the user's beside it, `outside/`."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "params.yaml").write_text("{}\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "user.png").write_bytes(b"the user's figure")
    (tmp_path / "outside" / "part-tables.parquet").write_bytes(b"the user's table")
    return tmp_path / "ws"


def link_out(ws: Path, relative: str) -> Path:
    """`ws/relative` committed as a symlink to the folder outside the workspace."""
    path = ws / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(ws.parent / "outside", target_is_directory=True)
    return path


def outside(ws: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: state(p) for p in sorted((ws.parent / "outside").iterdir())}


def test_report_refuses_a_symlinked_figures_folder_and_deletes_nothing_outside(ws: Path) -> None:
    before = outside(ws)
    figures = link_out(ws, "reports/figures")
    with pytest.raises(
        OutsidePath, match=rf"^{figures} is a symlink .*lmgeo writes only inside {ws}; .*`rm {figures}`"
    ):
        render_report(ws / "reports/tables", ws / "reports/report.md", figures, {})
    assert outside(ws) == before
    assert sorted(p.name for p in (ws / "reports").iterdir()) == ["figures"]


def test_report_deletes_only_the_figures_its_last_report_showed(ws: Path) -> None:
    figures = ws / "reports" / "figures"
    figures.mkdir(parents=True)
    (ws / "reports" / "report.md").write_text("![a](figures/a.png)\n![b](elsewhere/b.png)\n[c](figures/c.png)\n")
    shown = previous_figures(ws / "reports" / "report.md", figures, Path("figures"))
    assert shown == [figures / "a.narrow.png", figures / "a.png", figures / "c.narrow.png", figures / "c.png"]
    assert previous_figures(ws / "reports" / "absent.md", figures, Path("figures")) == []


def test_report_refuses_a_previous_figure_that_is_a_symlink_out(ws: Path) -> None:
    figures = ws / "reports" / "figures"
    figures.mkdir(parents=True)
    (figures / "a.png").symlink_to(ws.parent / "outside" / "user.png")
    (ws / "reports" / "report.md").write_text("![a](figures/a.png)\n")
    with pytest.raises(OutsidePath, match=r"^'a.png' is a symlink"):
        previous_figures(ws / "reports" / "report.md", figures, Path("figures"))
    assert (ws.parent / "outside" / "user.png").read_bytes() == b"the user's figure"


def test_aggregate_writer_refuses_a_symlinked_tables_folder_and_overwrites_nothing(ws: Path) -> None:
    before = outside(ws)
    tables = link_out(ws, "reports/tables")
    with pytest.raises(OutsidePath, match=rf"^{tables} is a symlink"):
        with ShardWriter(tables, "tables", KEY) as writer:
            writer.write({}, TABLE, name="part-tables.parquet")
    assert outside(ws) == before


def test_report_inputs_refuse_a_symlinked_tables_folder(ws: Path) -> None:
    tables = link_out(ws, "reports/tables")
    with pytest.raises(OutsidePath, match=rf"^{tables} is a symlink"):
        report_inputs(Layout(ws))


def test_writer_refuses_a_partition_folder_symlinked_into_another_dataset(ws: Path) -> None:
    fits, perturb = ws / "data" / "fits", ws / "data" / "perturb"
    with ShardWriter(fits, "s", KEY) as writer:
        writer.write({"model": "m"}, TABLE, name="part.parquet")
    theirs = state(fits / "model=m" / "part.parquet")
    perturb.mkdir(parents=True)
    (perturb / "model=m").symlink_to(fits / "model=m", target_is_directory=True)
    with pytest.raises(OutsidePath, match=rf"^{perturb / 'model=m'} is a symlink .*inside {perturb}"):
        with ShardWriter(perturb, "s", KEY) as writer:
            writer.write({"model": "m"}, TABLE, name="part.parquet")
    assert state(fits / "model=m" / "part.parquet") == theirs
    assert not manifest_path(perturb, "s").exists()


def test_atomic_write_and_prune_refuse_a_symlinked_folder(ws: Path) -> None:
    before = outside(ws)
    plots = link_out(ws, "reports/plots")
    with pytest.raises(OutsidePath, match=rf"^{plots} is a symlink"):
        atomic_write(plots / "user.png", "overwritten")
    with pytest.raises(OutsidePath, match=rf"^{plots} is a symlink"):
        prune_shards(plots, set())
    assert outside(ws) == before


def dvc_link(ws: Path, path: Path, cache: Path) -> Path:
    """Move `path` into `cache` (as DVC stores it, read-only) and leave a symlink to it in its place."""
    target = cache / "files" / "md5" / path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(path, target)
    target.chmod(0o444)
    path.symlink_to(target)
    return target


@pytest.mark.parametrize("configured", [None, "config", "config.local"])
def test_dvc_symlink_cache_is_read_kept_and_replaced_like_copies(ws: Path, configured: str | None) -> None:
    cache = ws / ".dvc" / "cache"
    (ws / ".dvc").mkdir()
    if configured:  # `dvc cache dir ../../shared-cache`: relative to .dvc
        (ws / ".dvc" / configured).write_text("[cache]\n    dir = ../../shared-cache\n")
        cache = ws.parent / "shared-cache"
    fits = ws / "data" / "fits"
    with ShardWriter(fits, "s", KEY) as writer:
        writer.write({"model": "m"}, TABLE, name="part.parquet")
    write_plan(fits, {"s": KEY})
    part, manifest = fits / "model=m" / "part.parquet", manifest_path(fits, "s")
    cached = [dvc_link(ws, part, cache), dvc_link(ws, manifest, cache)]
    contents = [state(c) for c in cached]
    assert in_dvc_cache(part)
    assert verified_files(fits) == [part]
    assert prune_shards(fits, {"s"}) == 0
    assert part.is_symlink() and manifest.is_symlink()
    with ShardWriter(fits, "s", KEY) as writer:  # a rerun replaces the links, never writes through them
        writer.write({"model": "m"}, TABLE, name="part.parquet")
    assert not part.is_symlink() and verified_files(fits) == [part]
    assert [state(c) for c in cached] == contents


def test_a_symlinked_shard_file_outside_the_dvc_cache_is_still_refused(ws: Path) -> None:
    (ws / ".dvc" / "cache").mkdir(parents=True)
    fits = ws / "data" / "fits"
    with ShardWriter(fits, "s", KEY) as writer:
        writer.write({"model": "m"}, TABLE, name="part.parquet")
    part = fits / "model=m" / "part.parquet"
    dvc_link(ws, part, ws.parent / "elsewhere")
    assert not in_dvc_cache(part)
    with pytest.raises(Exception, match=r"corrupt shard: .*'model=m/part.parquet' is a symlink"):
        verified_files(fits)
