"""A Ray cluster without a shared filesystem (SPEC §1), set up with docs/cluster.md's commands as written.

The head (`ray start --head --num-cpus=0`: it runs no task) and the driver run on this machine, in the
workspace; the only node with CPUs is a worker started in its own mount namespace (`unshare -m`) where
the workspaces and the checkout are hidden under empty tmpfs mounts. It runs with this environment's
Python, bind-mounted elsewhere before the checkout (which may hold the venv) is hidden. The tiny study's
train, extract, fit and perturb stages run through that cluster, and every file they write under `data/`
(Parquet shards, checkpoints, manifests, plans) has the bytes of the same stages run by an embedded Ray.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ray_nodes import free_port, start_node, stop_process_group
from reliability_helpers import copy_workspace, lmgeo, preset_overrides, write_params

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
README = REPO / "docs" / "cluster.md"
STAGES = ("train", "extract", "fit", "perturb")
STUDY = {
    **preset_overrides("tiny"),
    "train.matched_budget": "null",
    "train.archs": '["neox"]',
    "train.recipes": '["adamw"]',
    "ray.shards_per_task": "2",  # the driver writes each shard of a task as it arrives
}


def unshare_refused() -> str | None:
    """Why a mount namespace cannot be made here (None when it can)."""
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux's unshare(1)"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return f"unshare -m is not permitted here (root needed): {probe.stderr.strip()}" if probe.returncode else None


def readme_cluster_commands() -> dict[str, list[str]]:
    """docs/cluster.md's cluster commands by role (`token`, `head`, `worker`, `driver`), each as argv."""
    text = README.read_text()
    section = text[text.index("## A Ray cluster, no shared filesystem") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert len(lines) == 4, block
    return dict(zip(("token", "head", "worker", "driver"), map(shlex.split, lines), strict=True))


def as_written(argv: list[str], port: int, token: str) -> list[str]:
    return [
        arg.replace("<head-node>:6379", f"127.0.0.1:{port}")
        .replace("<token>", token)
        .replace("--port=6379", f"--port={port}")
        for arg in argv
    ]


def data_files(workspace: Path) -> dict[str, bytes]:
    data = workspace / "data"
    return {p.relative_to(data).as_posix(): p.read_bytes() for p in sorted(data.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def hidden(tmp_path_factory) -> Path:
    """The folder holding the workspaces, hidden from the worker node."""
    return tmp_path_factory.mktemp("hidden")


@pytest.fixture(scope="module")
def prepared(hidden: Path) -> Path:
    workspace = hidden / "prepared"
    workspace.mkdir()
    write_params(workspace, STUDY)
    lmgeo(workspace, "prepare")
    return workspace


def test_stages_on_a_worker_that_sees_neither_workspace_nor_checkout_write_what_a_local_run_writes(
    prepared: Path, hidden: Path, tmp_path: Path
) -> None:
    refused = unshare_refused()
    if refused:
        pytest.skip(refused)
    local = copy_workspace(prepared, hidden / "local")
    for stage in STAGES:
        lmgeo(local, stage)

    commands = readme_cluster_commands()
    assert commands["token"] == ["ray", "get-auth-token", "--generate"]
    assert commands["head"][:3] == ["ray", "start", "--head"] and "--num-cpus=0" in commands["head"]
    assert commands["worker"][-3:-1] == ["ray", "start"] and commands["driver"][0] == "export"
    port = free_port()
    head_home, driver_home = tmp_path / "head", tmp_path / "driver"
    head_home.mkdir(), driver_home.mkdir()
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    plain["RAY_USAGE_STATS_ENABLED"] = "0"
    ray_cli = str(Path(sys.executable).parent / "ray")
    head_env = {**plain, "HOME": str(head_home)}
    token = subprocess.run(
        [ray_cli, *commands["token"][1:]], env=head_env, capture_output=True, text=True, check=True
    ).stdout.strip()
    quiet = ["--include-dashboard=false", "--disable-usage-stats", "--block"]
    head_start = [ray_cli, *as_written(commands["head"], port, token)[1:], *quiet]
    head = start_node(head_start, head_env, tmp_path / "head.log")
    try:
        worker = start_node(
            hidden_node(as_written(commands["worker"], port, token), hidden, tmp_path),
            {**plain, "HOME": str(tmp_path)},
            tmp_path / "worker.log",
        )
        try:
            cluster = copy_workspace(prepared, hidden / "cluster")
            driver_env = {
                "HOME": str(driver_home),
                **dict(a.split("=", 1) for a in as_written(commands["driver"], port, token)[1:]),
            }
            for stage in STAGES:
                done = run_driver(cluster, stage, {**plain, **driver_env})
                assert re.search(r"(shards|runs) done", done.stdout + done.stderr), done.stdout  # train counts runs
        finally:
            stop_process_group(worker)
    finally:
        stop_process_group(head)
    worker_log = (tmp_path / "worker.log").read_text()
    assert "hidden: yes" in worker_log, worker_log

    local_files, cluster_files = data_files(local), data_files(cluster)
    for dataset in ("models", "train", "activations", "fits", "perturb"):
        assert any(
            name.startswith(f"{dataset}/") and name.endswith((".parquet", ".safetensors")) for name in local_files
        ), dataset
    assert local_files.keys() == cluster_files.keys()
    assert [name for name in local_files if local_files[name] != cluster_files[name]] == []


def hidden_node(worker: list[str], hidden: Path, tmp_path: Path) -> list[str]:
    """`RAY_AUTH_MODE=token RAY_AUTH_TOKEN=… ray start …` (the README's worker command) as a process in its own mount
    namespace where `hidden` and the checkout are empty tmpfs mounts, run by this Python bind-mounted
    outside them (the `ray` script's first line names a path in the hidden venv)."""
    at = worker.index("ray")
    assignments, ray_start = worker[:at], worker[at + 1 :]
    python = Path(sys.executable)
    prefix = Path(sys.prefix)
    venv = tmp_path / "python"
    venv.mkdir()
    shell = " && ".join(
        [
            f"mount --bind {shlex.quote(str(prefix))} {shlex.quote(str(venv))}",
            f"mount -t tmpfs tmpfs {shlex.quote(str(REPO))}",
            f"mount -t tmpfs tmpfs {shlex.quote(str(hidden))}",
            f"test ! -e {shlex.quote(str(REPO / 'pyproject.toml'))}",
            f'test -z "$(ls -A {shlex.quote(str(hidden))})"',
            "echo 'hidden: yes'",
            "cd /",  # a working directory inside the checkout would still reach it
            f"exec env {' '.join(map(shlex.quote, assignments))} {shlex.quote(str(venv / python.relative_to(prefix)))} "
            f"-m ray.scripts.scripts {' '.join(map(shlex.quote, ray_start))} --num-cpus=2 "
            "--disable-usage-stats --block",
        ]
    )
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", shell]


def run_driver(workspace: Path, stage: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`lmgeo <stage>` in the workspace, joining the cluster by the README's `export`s."""
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lmgeo"), stage],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{stage}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done
