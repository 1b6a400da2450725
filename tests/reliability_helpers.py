"""Fault injection for `tests/test_reliability.py`: workspaces, stage processes, kills and file snapshots.

A workspace is a folder holding `params.yaml` and `data/`; the stage commands read both from their
working directory and import lmgeo from the installed package, so no source needs copying.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from lmgeo.core.config import flatten_overrides, load_yaml
from lmgeo.core.store import (
    MANIFEST_DIR,
    ManifestKey,
    ShardWriter,
    manifest_path,
    verified_files,
)
from lmgeo.params import Params, apply_overrides, load_params

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGE_TIMEOUT_S = 300

# Every stage of a pipeline run in one process, the way `lmgeo <stage>` runs each (lmgeo/cli.py), so
# that Ray starts once per pipeline instead of once per stage.
_PIPELINE = (
    "import importlib, sys\n"
    "from lmgeo.driver.layout import Layout\n"
    "from lmgeo.params import load_params\n"
    "params = load_params('params.yaml')\n"
    "for stage in sys.argv[1:]:\n"
    "    importlib.import_module(f'lmgeo.stages.{stage}').run(params, Layout.here())\n"
)


def env() -> dict[str, str]:
    """The test's environment for stage processes: our venv first, an embedded Ray, no progress bars."""
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "RAY_ADDRESS": "",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


def write_params(workspace: Path, overrides: dict[str, str], name: str = "params.yaml") -> Path:
    """`workspace/name` = the workspace's params (the defaults when absent) with `overrides` applied."""
    current = workspace / "params.yaml"
    params = apply_overrides(load_params(current) if current.exists() else Params(), overrides)
    path = workspace / name
    path.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    return path


def write_raw_params(workspace: Path, name: str, edit: Callable[[dict], None]) -> Path:
    """A params file `name`: the workspace's params.yaml as a plain mapping, changed by `edit`."""
    raw = yaml.safe_load((workspace / "params.yaml").read_text())
    edit(raw)
    path = workspace / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def preset_overrides(name: str) -> dict[str, str]:
    return flatten_overrides(load_yaml(REPO / "presets" / f"{name}.yaml"))


def lmgeo(workspace: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run([str(BIN / "lmgeo"), *args], workspace, check)


def run_pipeline(workspace: Path, *stages: str) -> subprocess.CompletedProcess:
    """Run `stages` in order in one process (one embedded Ray); raises with the output on failure."""
    return _run([sys.executable, "-c", _PIPELINE, *stages], workspace, check=True)


def _run(cmd: list[str], cwd: Path, check: bool) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=STAGE_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{cmd[-1]} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def start_stage(workspace: Path, stage: str, log: Path) -> subprocess.Popen:
    """`lmgeo <stage>` in the background, in its own process group, its output going to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(BIN / "lmgeo"), stage],
            cwd=workspace,
            env=env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def copy_workspace(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


# ------------------------------------------------------------------------------------------ processes
def title(proc: psutil.Process) -> str:
    """The process title as `ps` shows it: Ray renames its workers `ray::<task>` while they run one."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05) -> object:
    """Poll `condition` until it returns something truthy; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The processes of `procs` that still run (a zombie has exited: only its exit status is left)."""
    running = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(proc)
        except psutil.NoSuchProcess:
            pass
    return running


def kill_all(procs: Iterable[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def busy_worker(driver_pid: int, task_title: str, for_s: float) -> Callable[[], psutil.Process | None]:
    """A probe for `wait_for`: a Ray worker under `driver_pid` that has shown `task_title` (its
    process title while it runs that task) on every poll for at least `for_s` seconds, or None."""
    first_seen: dict[int, float] = {}

    def probe() -> psutil.Process | None:
        now = time.monotonic()
        busy = {p.pid: p for p in descendants(driver_pid) if title(p).startswith(task_title)}
        for pid in set(first_seen) - set(busy):
            del first_seen[pid]
        return next((p for pid, p in busy.items() if now - first_seen.setdefault(pid, now) >= for_s), None)

    return probe


def watching(pid: int, condition: Callable[[], object]) -> tuple[dict[psutil.Process, str], Callable[[], object]]:
    """`condition` as a probe for `wait_for` that also records, on every poll, each descendant of `pid` with its
    last readable title: the family the process had while it ran, not only at one instant (a Ray process that
    ended or was being replaced at that instant would be missed)."""
    seen: dict[psutil.Process, str] = {}

    def probe() -> object:
        for child in descendants(pid):
            seen[child] = title(child) or seen.get(child, "")
        return condition()

    return seen, probe


def stop(proc: subprocess.Popen) -> None:
    """Make sure a stage started by `start_stage` and everything under it is gone (test clean-up)."""
    kill_all(alive(descendants(proc.pid)))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def kill_group(proc: subprocess.Popen) -> dict[psutil.Process, str]:
    """SIGKILL the process group `proc` leads; returns its descendants as they were just before, each with its
    title read then (a killed process's title cannot be read afterwards: it is reaped or a zombie)."""
    family = {child: title(child) for child in descendants(proc.pid)}
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return family


# ------------------------------------------------------------------------------------------ files
def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """relative path -> (mtime_ns, sha256) of every file under `root`."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        files[path.relative_to(root).as_posix()] = (path.stat().st_mtime_ns, digest)
    return files


def manifest_times(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted((root / MANIFEST_DIR).glob("*.json"))}


def dataset_rows(root: Path, sort_by: list[str]) -> pa.Table:
    """Every row of the complete shards under `root` (vectors included), in a stable order."""
    tables = []
    for path in verified_files(root):
        table = pq.read_table(path).replace_schema_metadata(None)
        for part in path.relative_to(root).parent.parts:  # hive partitions: key=value
            name, value = part.split("=", 1)
            table = table.append_column(name, pa.array([value] * table.num_rows, pa.string()))
        tables.append(table)
    return pa.concat_tables(tables).sort_by([(c, "ascending") for c in sort_by])


def rewrite_shard(root: Path, shard: str, change: Callable[[dict[str, str], pa.Table], pa.Table]) -> None:
    """Rewrite a complete shard through the store (`ShardWriter`, same key and file metadata), each
    file's rows passed through `change(partition, table)`: the result is a valid shard, as if the
    stage had written it."""
    import json

    manifest = json.loads(manifest_path(root, shard).read_text())
    key = ManifestKey(manifest["inputs"], manifest["params_hash"], manifest["code_version"])
    files = [(entry["path"], pq.read_table(root / entry["path"])) for entry in manifest["files"]]
    metadata = {
        k.decode(): v.decode()
        for k, v in (files[0][1].schema.metadata or {}).items()
        if not k.startswith((b"lmgeo.", b"ARROW:"))
    }
    with ShardWriter(root, shard, key, metadata=metadata) as writer:
        for rel, table in files:
            partition = dict(part.split("=", 1) for part in Path(rel).parent.parts)
            writer.write(partition, change(partition, table.replace_schema_metadata(None)))
