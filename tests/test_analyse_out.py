"""`lmgeo analyse --out`: the folders it refuses to write, each in one line before any stage runs."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmgeo import cli
from lmgeo.commands import analyse as tool
from lmgeo.core.errors import InputError
from lmgeo.params import default_study


def fake_model(root: Path) -> Path:
    """A folder that passes analyse's quick checks (config of a causal LM, tokenizer file): enough for refusals."""
    model = root / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (model / "tokenizer.json").write_text("{}")
    return model


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_study_holding_an_analysis_marker_of_the_model_is_refused(tmp_path: Path) -> None:
    """A marker copied into a study does not make it analyse's: `dvc.yaml` (or `.dvc`, `.git`) is a study's, so
    the refusal to overwrite a folder analyse did not write applies, and nothing in it changes."""
    source = tool.ModelSource(str(fake_model(tmp_path)), "my-model")
    for foreign in ("dvc.yaml", ".git"):
        study = tmp_path / f"study-{foreign}"
        study.mkdir()
        (study / "params.yaml").write_text("study: mine\n")
        (study / foreign).write_text("stages: {}\n")
        tool._write_marker(study, source, None)
        before = snapshot(study)
        listed = "params.yaml, dvc.yaml" if foreign == "dvc.yaml" else "params.yaml, .git"
        with pytest.raises(InputError) as refused:
            tool.output_folder(study, source)
        assert str(refused.value) == (
            f"--out {study}: holds a study ({listed}) that `lmgeo analyse` did not write; name a new folder"
        )
        assert snapshot(study) == before


def test_a_dangling_out_symlink_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--out` a symlink to nothing: one line naming the target, exit 2, nothing created at either end."""
    model = fake_model(tmp_path)
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.app, ["analyse", str(model), "--out", str(link)])
    assert result.exit_code == 2
    assert result.stderr == (
        f"lmgeo: error: --out {link}: a symlink to {tmp_path / 'gone'}, which does not exist; name a real folder\n"
    )
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def test_a_second_analysis_of_one_out_folder_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    """While one analysis holds `--out` (its lock), a second, of another model or the same one, is refused before
    it writes anything: the first's marker (which names its model) stays as it was."""
    first = tool.ModelSource(str(fake_model(tmp_path)), "my-model")
    out = tmp_path / "out"
    out.mkdir()
    tool._write_marker(out, first, None)
    with open(out / tool.LOCK, "a") as held:  # the first analysis, mid-run
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(out)
        for name in ("my-model", "other-model"):
            second = tool.ModelSource(str(tmp_path / name), name)
            with pytest.raises(InputError) as refused:
                tool.run(default_study(), source=second, out=out)
            assert str(refused.value) == (
                f"--out {out}: another `lmgeo analyse` is writing this folder; wait for it to finish, or name another"
            )
            assert snapshot(out) == before
    with tool.exclusive(out):  # released with the first: the next analysis takes it
        assert tool.output_folder(out, first) == out


def test_the_lock_file_alone_does_not_make_a_folder_foreign(tmp_path: Path) -> None:
    """A folder left with only the lock file (an analysis refused before its marker) is still an empty one."""
    source = tool.ModelSource(str(tmp_path / "my-model"), "my-model")
    out = tmp_path / "out"
    out.mkdir()
    with tool.exclusive(out):
        assert tool.output_folder(out, source) == out
    assert [p.name for p in out.iterdir()] == [tool.LOCK]


def test_a_hub_id_longer_than_a_file_name_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's name becomes folder names (`analyse-<org>--<name>`, `<org>--<name>-random`): a hub id (or a
    local folder's name) too long for a file name is refused in one line, exit 2, before any folder is made
    (not an `OSError` traceback)."""
    hub_id = "org/" + "m" * 260
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.app, ["analyse", hub_id])
    assert result.exit_code == 2
    assert result.stderr == (
        f"lmgeo: error: {hub_id[:60]}…: a model name of 264 characters; the folders named after it "
        f"(analyse-org--{'m' * 27}…) would be longer than a file name (255 bytes): give a shorter hub id "
        "(`org/name`), or rename the model folder\n"
    )
    assert list(tmp_path.iterdir()) == []
    assert tool.locate_model("org/" + "m" * 200).name == "org/" + "m" * 200  # long, but still fits
    local = fake_model(tmp_path).rename(tmp_path / ("m" * 250))
    with pytest.raises(InputError, match=r"^m{60}…: a model name of 250 characters; the folders named after it"):
        tool.locate_model(str(local.relative_to(tmp_path)))
