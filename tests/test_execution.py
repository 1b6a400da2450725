"""The Ray execution layer: run_shards, Progress, start_ray.

Most tests use the session's embedded Ray (``ray_local``, 2 CPUs; they are marked slow, as is every
test that starts Ray: ``make check`` leaves them out). The cluster tests run their
driver in a subprocess (see conftest): one against a two-node ``ray.cluster_utils.Cluster`` whose
second node has a GPU slot and a ``fake_gpu`` custom resource, so routing by resources is really
exercised; one against a separately started ``ray start --head`` process joined through
``RAY_ADDRESS``. Their driver code is the ``scenario_*`` functions at the bottom of this module.
"""

from __future__ import annotations

import io
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray_nodes import free_port, start_node, stop_process_group

from lmgeo.core.config import RayConfig, TaskResources
from lmgeo.core.errors import InputError
from lmgeo.core.execution import Load, Shard, ShardFailed, run_shards
from lmgeo.core.progress import Progress, format_duration, time_left_s
from lmgeo.driver.runtime import NOTICE_LOGGERS, VERBOSE_ENV, quiet_ray, resolve_address, show_notices, start_ray

REPO = Path(__file__).resolve().parent.parent
ONE_CPU = TaskResources(num_cpus=1)


# ------------------------------------------------------------- task functions (run in workers)
def square(x: int) -> int:
    return x * x


def whereabouts() -> dict[str, object]:
    return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}


def fail_if(x: int, bad: int) -> int:
    if x == bad:
        raise ValueError(f"boom at {x}")
    return x


def die_first_time(marker: str) -> str:
    """Kill the worker process on the first attempt, succeed on a retry."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os._exit(1)
    return "survived"


def die() -> None:
    os._exit(1)


def wait_for_file(path: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


def shipped_sources() -> list[str]:
    """The folders on this worker's sys.path that hold lmgeo's packages."""
    return [folder for folder in sys.path if (Path(folder) / "lmgeo").is_dir()]


@ray.remote(num_cpus=0)
class Occupancy:
    """Counts the tasks running right now and the most that ever ran at once."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1

    def get_peak(self) -> int:
        return self.peak


def occupy(tracker: ray.actor.ActorHandle, target: int, hold_s: float) -> None:
    """Run until `target` tasks have been seen at once, then hold a little longer.

    The wait makes the bound reachable for sure; the hold gives any task submitted beyond the bound
    time to start and be counted, so a broken bound shows up in the peak.
    """
    ray.get(tracker.enter.remote())
    deadline = time.monotonic() + 60
    while ray.get(tracker.get_peak.remote()) < target and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(hold_s)
    ray.get(tracker.leave.remote())


# ------------------------------------------------------------------------------------ progress
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_prints_plain_lines_when_not_a_tty() -> None:
    out = io.StringIO()
    progress = Progress(3, "fit", stream=out)
    progress.advance(detail="gpt2-adamw-s0.final/layer=1")
    progress.advance(detail="b")
    progress.advance()
    progress.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"fit: 1/3 shards done \(gpt2-adamw-s0\.final/layer=1\) \[\d+\.\ds, \d+s left\]", lines[0])
    assert re.fullmatch(r"fit: 3/3 shards done \[\d+\.\ds\]", lines[2])


def test_progress_throttles_plain_lines_but_always_prints_the_last() -> None:
    out = io.StringIO()
    with Progress(100, "train gpt2-muon-s0", unit="steps", stream=out, min_interval_s=3600) as progress:
        for step in range(100):
            progress.advance(detail=f"loss {1 / (step + 1):.3f}")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "train gpt2-muon-s0: 1/100 steps done",
        "train gpt2-muon-s0: 100/100 steps done",
    ]


def test_progress_draws_a_live_bar_on_a_tty() -> None:
    out = _Terminal()
    with Progress(2, "extract", stream=out) as progress:
        progress.advance(detail="m/seq=0")
        progress.advance(detail="m/seq=16")
    text = out.getvalue()
    assert "extract" in text and "2/2" in text and "m/seq=16" in text
    assert "shards done" not in text  # not the plain-line format


def test_time_left_is_the_finished_items_pace_counted_down_between_them() -> None:
    assert time_left_s(0, 4, 0.0, 30.0) is None  # nothing finished: nothing to go by
    assert time_left_s(1, 4, 10.0, 10.0) == 30.0  # one item in 10 s: three more take 30 s
    assert time_left_s(2, 4, 10.0, 14.0) == 6.0  # two in 10 s (they ran at once), 4 s since
    assert time_left_s(1, 2, 10.0, 60.0) == 0.0  # late: never below zero
    assert time_left_s(4, 4, 40.0, 40.0) == 0.0


def test_durations_read_as_a_person_reads_them() -> None:
    assert [format_duration(s) for s in (4.4, 59.6, 185, 7620)] == ["4s", "1m00s", "3m05s", "2h07m"]


def test_a_live_bar_counts_runs_and_shows_the_time_left() -> None:
    out = _Terminal()
    with Progress(3, "train", unit="runs", stream=out) as progress:
        progress.advance(detail="neox-adamw-s0")
        text = out.getvalue()
    assert "1/3" in text and "runs" in text and re.search(r"\d+s left", text), text


def test_ray_start_up_notices_and_log_dedup_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    monkeypatch.delenv("RAY_DEDUP_LOGS", raising=False)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")  # the user's own setting wins
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    quiet_ray()
    assert os.environ["RAY_DEDUP_LOGS"] == "0" and os.environ["RAY_USAGE_STATS_ENABLED"] == "1"
    show_notices()
    assert NOTICE_LOGGERS and all(logging.getLogger(n).level == logging.ERROR for n in NOTICE_LOGGERS)
    monkeypatch.setenv(VERBOSE_ENV, "1")
    show_notices()
    assert all(logging.getLogger(n).level == logging.NOTSET for n in NOTICE_LOGGERS)


def test_verbose_option_asks_for_rays_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from lmgeo.cli import app

    monkeypatch.setenv(VERBOSE_ENV, "0")  # and unset again after the test
    assert CliRunner().invoke(app, ["--verbose", "families", "--help"]).exit_code == 0
    assert os.environ.get(VERBOSE_ENV) == "1"


# ---------------------------------------------------------------------------------- run_shards
def test_zero_shards_return_at_once_without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert run_shards([], ONE_CPU, max_in_flight=2, max_retries=0, label="fit") == {}
    with pytest.raises(RuntimeError, match="start_ray"):
        run_shards([Shard("a", square, (2,))], ONE_CPU, max_in_flight=2, max_retries=0, label="fit")


def test_duplicate_shard_keys_are_refused() -> None:
    shards = [Shard("a", square, (1,)), Shard("b", square, (2,)), Shard("a", square, (3,))]
    with pytest.raises(ValueError, match=r"duplicate shard keys: \['a'\]"):
        run_shards(shards, ONE_CPU, max_in_flight=2, max_retries=0, label="fit")


@pytest.mark.slow  # the session's embedded Ray
def test_results_are_collected_as_they_arrive(ray_local, capsys: pytest.CaptureFixture[str]) -> None:
    shards = [Shard(f"sq{i}", square, (i,)) for i in range(5)]
    results = run_shards(shards, ONE_CPU, max_in_flight=2, max_retries=0, label="squares")
    assert results == {f"sq{i}": i * i for i in range(5)}
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" shards")[0] for line in lines] == [f"squares: {n}/5" for n in range(1, 6)]


def threads_in_task() -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.slow  # the session's embedded Ray
@pytest.mark.parametrize("cpus", [1, 2])
def test_every_task_runs_with_the_thread_count_of_its_resources(ray_local, cpus: int) -> None:
    shards = [Shard(f"t{i}", threads_in_task) for i in range(2)]
    threads = run_shards(shards, TaskResources(num_cpus=cpus), max_in_flight=2, max_retries=0, label="t")
    assert set(threads.values()) == {cpus}


@pytest.mark.slow  # the session's embedded Ray
def test_a_worker_running_other_code_than_planned_refuses_the_task(ray_local) -> None:
    from lmgeo.core.execution import CodeMismatch
    from lmgeo.core.fingerprint import CodeSpec, code_version

    spec = CodeSpec("lmgeo.stages.fit", ("lmgeo.study_a.classes.lowrank",))
    planned = Shard("ok", square, (3,), code=(spec, code_version(spec)))
    assert run_shards([planned], ONE_CPU, max_in_flight=1, max_retries=0, label="fit") == {"ok": 9}
    other = Shard("stale", square, (3,), code=(spec, "0.1.0+0000000000000000"))
    with pytest.raises(ShardFailed) as failure:
        run_shards([other], ONE_CPU, max_in_flight=1, max_retries=0, label="fit")
    assert isinstance(failure.value.cause, CodeMismatch)
    assert "planned version 0.1.0+0000000000000000" in str(failure.value)


@pytest.mark.slow  # the session's embedded Ray
def test_keyword_arguments_reach_the_task(ray_local) -> None:
    shards = [Shard(f"sq{i}", square, kwargs={"x": i}) for i in range(3)]
    assert run_shards(shards, ONE_CPU, max_in_flight=8, max_retries=0, label="squares") == {
        "sq0": 0,
        "sq1": 1,
        "sq2": 4,
    }


@pytest.mark.slow  # the session's embedded Ray
@pytest.mark.parametrize("max_in_flight", [1, 3])
def test_in_flight_tasks_are_bounded(ray_local, monkeypatch: pytest.MonkeyPatch, max_in_flight: int) -> None:
    waited_on = []
    real_wait = ray.wait

    def counting_wait(refs, **kwargs):
        waited_on.append(len(refs))
        return real_wait(refs, **kwargs)

    monkeypatch.setattr(ray, "wait", counting_wait)
    tracker = Occupancy.remote()
    shards = [Shard(f"s{i}", occupy, (tracker, max_in_flight, 0.3)) for i in range(6)]
    # Half a CPU per task: the 2-CPU Ray could run 4 at once, so only run_shards limits them.
    run_shards(shards, TaskResources(num_cpus=0.5), max_in_flight=max_in_flight, max_retries=0, label="occupy")
    assert max(waited_on) == max_in_flight
    assert ray.get(tracker.get_peak.remote()) == max_in_flight


@pytest.mark.slow  # the session's embedded Ray
def test_a_failing_task_is_reported_with_its_shard(ray_local) -> None:
    shards = [Shard(f"part-{i}", fail_if, (i, 1)) for i in range(4)]
    with pytest.raises(ShardFailed) as failure:
        run_shards(shards, ONE_CPU, max_in_flight=1, max_retries=0, label="fit")
    assert failure.value.key == "part-1"
    assert isinstance(failure.value.cause, ValueError)
    assert str(failure.value).startswith("shard 'part-1' failed: ValueError: boom at 1")
    assert "fail_if" in str(failure.value)  # the remote traceback comes along


@pytest.mark.slow  # the session's embedded Ray
@pytest.mark.timeout(90)
def test_a_failure_cancels_the_tasks_in_flight(ray_local, tmp_path: Path) -> None:
    never = str(tmp_path / "never-created")
    blocked = [Shard(f"blocked-{i}", wait_for_file, (never, 600)) for i in range(3)]
    shards = [*blocked, Shard("bad", fail_if, (1, 1))]
    with pytest.raises(ShardFailed, match="'bad'"):
        run_shards(shards, TaskResources(num_cpus=0.5), max_in_flight=4, max_retries=0, label="fit")
    # Needs both CPUs: schedulable only because the blocked tasks were cancelled (else: timeout).
    assert run_shards(
        [Shard("all-cpus", square, (3,))], TaskResources(num_cpus=2), max_in_flight=1, max_retries=0, label="after"
    ) == {"all-cpus": 9}


@pytest.mark.slow
def test_a_dead_worker_is_retried_then_reported(ray_local, tmp_path: Path) -> None:
    marker = str(tmp_path / "died-once")
    assert run_shards(
        [Shard("phoenix", die_first_time, (marker,))], ONE_CPU, max_in_flight=1, max_retries=1, label="retry"
    ) == {"phoenix": "survived"}
    with pytest.raises(ShardFailed, match="shard 'doomed' failed"):
        run_shards([Shard("doomed", die)], ONE_CPU, max_in_flight=1, max_retries=0, label="retry")


@pytest.mark.slow  # the session's embedded Ray
def test_resources_no_node_has_fail_fast_naming_them(ray_local) -> None:
    with pytest.raises(InputError, match=r"fit: no node .*'GPU': 1\.0"):
        run_shards([Shard("a", square, (1,))], TaskResources(num_gpus=1), max_in_flight=1, max_retries=0, label="fit")
    with pytest.raises(InputError, match="fake_gpu"):
        run_shards(
            [Shard("a", square, (1,))],
            TaskResources(resources={"fake_gpu": 1}),
            max_in_flight=1,
            max_retries=0,
            label="fit",
        )


@pytest.mark.slow  # the session's embedded Ray
def test_workers_get_the_code_ray_ships_from_this_checkout(ray_local) -> None:
    """Ray ships `lmgeo` (runtime_env py_modules) onto every worker's sys.path: a node
    without the checkout imports it from there (tests/test_cluster.py runs the stages on one)."""
    found = run_shards([Shard("src", shipped_sources)], ONE_CPU, max_in_flight=1, max_retries=0, label="src")["src"]
    for package in ("lmgeo",):
        shipped = [Path(f) / package for f in found if "py_modules" in f and (Path(f) / package).is_dir()]
        assert len(shipped) == 1, found
        assert _sources(shipped[0]) == _sources(REPO / package)


def _sources(package: Path) -> dict[str, bytes]:
    return {path.relative_to(package).as_posix(): path.read_bytes() for path in sorted(package.rglob("*.py"))}


# ------------------------------------------------------------------ data through the object store
def total(values: list[int]) -> int:
    return sum(values)


def nothing_written_yet(marker: str) -> bool:
    """In a worker: whether the driver has written the batch's first shard (its `write` makes `marker`)."""
    return wait_for_file(marker, timeout_s=60)


@pytest.mark.slow  # the session's embedded Ray
def test_an_input_is_read_once_by_the_driver_and_reaches_every_task_that_names_it(ray_local) -> None:
    reads: list[str] = []

    def read() -> list[int]:
        reads.append("values")
        return list(range(10))

    values = Load("values", read)
    shards = [Shard(f"s{i}", total, (values,)) for i in range(4)] + [Shard("kw", total, kwargs={"values": values})]
    results = run_shards(shards, ONE_CPU, max_in_flight=8, max_retries=0, label="loads")
    assert results == {key: 45 for key in ("s0", "s1", "s2", "s3", "kw")}
    assert reads == ["values"]


@pytest.mark.slow  # the session's embedded Ray
def test_each_shard_of_a_task_is_written_by_the_driver_as_it_arrives(ray_local, tmp_path: Path) -> None:
    """The second shard of a task waits for the driver to have written the first: only a task that streams
    its shards' results lets it finish in time (a task returning its batch at the end would wait in vain)."""
    marker = tmp_path / "first-written"
    written: list[str] = []

    def write_first(value: int) -> str:
        marker.touch()
        written.append("first")
        return f"wrote {value}"

    shards = [Shard("first", square, (3,), write=write_first), Shard("second", nothing_written_yet, (str(marker),))]
    results = run_shards(shards, ONE_CPU, max_in_flight=1, max_retries=0, label="stream", shards_per_task=2)
    assert results == {"first": "wrote 9", "second": True}
    assert written == ["first"]


@pytest.mark.slow
def test_a_task_whose_worker_dies_mid_batch_is_retried_and_each_shard_written_once(ray_local, tmp_path: Path) -> None:
    written: list[str] = []

    def record(value: object) -> object:
        written.append(str(value))
        return value

    marker = str(tmp_path / "died")
    shards = [Shard("a", square, (2,), write=record), Shard("b", die_first_time, (marker,), write=record)]
    results = run_shards(shards, ONE_CPU, max_in_flight=1, max_retries=1, label="retry", shards_per_task=2)
    assert results == {"a": 4, "b": "survived"}
    assert written == ["4", "survived"]


# ----------------------------------------------------------------------------------- start_ray
@pytest.mark.slow  # the session's embedded Ray
def test_start_ray_is_idempotent(ray_local) -> None:
    start_ray(RayConfig(num_cpus=1))
    assert ray.cluster_resources()["CPU"] == 2


def test_the_address_comes_from_the_flag_then_the_environment_then_params(monkeypatch: pytest.MonkeyPatch) -> None:
    in_params = RayConfig(address="10.0.0.3:6379")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert resolve_address(in_params, "10.0.0.1:6379") == "10.0.0.1:6379"
    assert resolve_address(in_params) == "10.0.0.2:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    assert resolve_address(in_params) == "10.0.0.3:6379"
    assert resolve_address(RayConfig()) is None  # embedded local Ray
    monkeypatch.setenv("RAY_ADDRESS", "")
    assert resolve_address(RayConfig()) is None


# ------------------------------------------------------------------------ real clusters (slow)
def _cluster_env(**extra: str) -> dict[str, str]:
    """The environment of a separate Ray: our own token (nothing read from ~/.ray), never RAY_ADDRESS
    from the caller, no usage reporting."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    env.update(extra)
    return env


def _run_driver(scenario: str, env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", f"import test_execution; test_execution.{scenario}()"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    assert f"{scenario}: ok" in proc.stdout


@pytest.mark.slow
def test_a_two_node_cluster_routes_tasks_by_resources() -> None:
    _run_driver("scenario_two_node_cluster", _cluster_env())


@pytest.mark.slow
def test_joins_a_ray_started_separately_by_address(tmp_path: Path) -> None:
    """The README's cluster path as a user follows it: on the head, `ray get-auth-token --generate` (the
    token in ~/.ray/auth_token turns on Ray's token authentication) and `ray start --head`; the driver on
    another account (its own HOME) given `RAY_ADDRESS` and the token as `RAY_AUTH_TOKEN`. Without the
    token: one clear error, at once."""
    port = free_port()
    head_home, driver_home = tmp_path / "head", tmp_path / "driver"
    head_home.mkdir(), driver_home.mkdir()
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    head_env = {**plain, "HOME": str(head_home), "RAY_USAGE_STATS_ENABLED": "0"}
    ray_cli = str(Path(sys.executable).parent / "ray")
    token = subprocess.run(
        [ray_cli, "get-auth-token", "--generate"], env=head_env, capture_output=True, text=True, check=True
    ).stdout.strip()
    log = tmp_path / "ray-head.log"
    head = start_node(
        [
            ray_cli,
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            "--num-gpus=0",
            '--resources={"joined_head": 1}',
            "--include-dashboard=false",
            "--disable-usage-stats",
            "--block",
        ],
        head_env,
        log,
    )
    try:
        assert "Token authentication is enabled" in log.read_text(), log.read_text()
        driver_env = {
            **plain,
            "HOME": str(driver_home),
            "RAY_ADDRESS": f"127.0.0.1:{port}",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        _run_driver("scenario_refused_without_the_token", driver_env)
        _run_driver("scenario_joined_by_address", {**driver_env, "RAY_AUTH_TOKEN": token})
    finally:
        stop_process_group(head)


def scenario_two_node_cluster() -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        gpu_node = cluster.add_node(num_cpus=1, num_gpus=1, resources={"fake_gpu": 1})
        cluster.wait_for_nodes()
        start_ray(RayConfig(num_cpus=7), address=cluster.address)  # num_cpus is for embedded Ray only
        assert ray.cluster_resources()["CPU"] == 2
        head, gpu = cluster.head_node.node_id, gpu_node.node_id

        def nodes_and_pids(resources: TaskResources, n: int, max_in_flight: int) -> tuple[set, list]:
            shards = [Shard(f"w{i}", whereabouts) for i in range(n)]
            found = run_shards(shards, resources, max_in_flight=max_in_flight, max_retries=0, label="where")
            return {r["node"] for r in found.values()}, [r["pid"] for r in found.values()]

        on_fake, _ = nodes_and_pids(TaskResources(num_cpus=0.25, resources={"fake_gpu": 0.25}), 6, 4)
        assert on_fake == {gpu}
        on_head, _ = nodes_and_pids(TaskResources(num_cpus=0.25, resources={"node:__internal_head__": 0.1}), 4, 4)
        assert on_head == {head}
        # GPU tasks get a fresh worker each (max_calls=1); the same tasks without a GPU reuse one.
        on_gpu, gpu_pids = nodes_and_pids(TaskResources(num_cpus=0, num_gpus=1), 3, 1)
        assert on_gpu == {gpu} and len(set(gpu_pids)) == 3
        _, cpu_pids = nodes_and_pids(TaskResources(num_cpus=0, resources={"fake_gpu": 1}), 3, 1)
        assert len(set(cpu_pids)) < 3

        failing = [Shard(f"remote-{i}", fail_if, (i, 2)) for i in range(4)]
        try:
            run_shards(
                failing,
                TaskResources(num_cpus=0.5, resources={"fake_gpu": 0.5}),
                max_in_flight=2,
                max_retries=0,
                label="fit",
            )
        except ShardFailed as err:
            assert str(err).startswith("shard 'remote-2' failed: ValueError: boom at 2"), err
        else:
            raise AssertionError("ShardFailed not raised")
        try:
            run_shards(
                [Shard("x", square, (1,))],
                TaskResources(resources={"fake_gpu": 2}),
                max_in_flight=1,
                max_retries=0,
                label="fit",
            )
        except ValueError as err:  # an InputError: one line, exit 2, in the CLI
            assert "fake_gpu" in str(err), err
        else:
            raise AssertionError("an infeasible task was accepted")
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("scenario_two_node_cluster: ok")


def scenario_refused_without_the_token() -> None:
    try:
        start_ray(RayConfig(num_cpus=1))
    except InputError as err:
        assert "RAY_AUTH_TOKEN" in str(err) and "\n" not in str(err), err
    else:
        raise AssertionError("joined a token-authenticated cluster without its token")
    print("scenario_refused_without_the_token: ok")


def scenario_joined_by_address() -> None:
    start_ray(RayConfig(num_cpus=7))  # joins RAY_ADDRESS; num_cpus is for embedded Ray only
    try:
        assert ray.cluster_resources().get("joined_head") == 1, ray.cluster_resources()
        shards = [Shard(f"sq{i}", square, (i,)) for i in range(4)]
        results = run_shards(
            shards,
            TaskResources(num_cpus=1, resources={"joined_head": 0.5}),
            max_in_flight=2,
            max_retries=1,
            label="squares",
        )
        assert results == {f"sq{i}": i * i for i in range(4)}, results
        try:
            run_shards([Shard("joined-bad", fail_if, (0, 0))], ONE_CPU, max_in_flight=1, max_retries=0, label="fit")
        except ShardFailed as err:
            assert "shard 'joined-bad' failed: ValueError: boom at 0" in str(err), err
        else:
            raise AssertionError("ShardFailed not raised")
    finally:
        ray.shutdown()
    print("scenario_joined_by_address: ok")


@pytest.mark.slow  # the session's embedded Ray
def test_small_shards_share_tasks_and_a_failure_still_names_its_shard(ray_local) -> None:
    shards = [Shard(f"sq{i}", square, (i,)) for i in range(7)]
    assert run_shards(shards, ONE_CPU, max_in_flight=2, max_retries=0, label="sq", shards_per_task=3) == {
        f"sq{i}": i * i for i in range(7)
    }
    failing = [Shard(f"part-{i}", fail_if, (i, 4)) for i in range(7)]
    with pytest.raises(ShardFailed) as failure:
        run_shards(failing, ONE_CPU, max_in_flight=1, max_retries=0, label="fit", shards_per_task=3)
    assert failure.value.key == "part-4" and str(failure.value).startswith("shard 'part-4' failed: ValueError")


def test_batches_are_consecutive_shards_of_one_function() -> None:
    from lmgeo.core.execution import _batches

    shards = [Shard(f"a{i}", square) for i in range(5)] + [Shard("b0", fail_if), Shard("a5", square)]
    assert [[s.key for s in b] for b in _batches(shards, 2)] == [["a0", "a1"], ["a2", "a3"], ["a4"], ["b0"], ["a5"]]
    assert all(len(b) == 1 for b in _batches(shards, 1))


def test_a_shard_expected_to_run_long_has_a_task_of_its_own() -> None:
    from lmgeo.core.execution import ALONE_S, _batches

    times = [1.0, 2.0, ALONE_S, 3.0, None, 4.0, ALONE_S * 10]
    shards = [Shard(f"s{i}", square, expected_s=t) for i, t in enumerate(times)]
    assert [[s.key for s in b] for b in _batches(shards, 8)] == [["s0", "s1"], ["s2"], ["s3", "s4", "s5"], ["s6"]]


def test_tasks_are_submitted_longest_first_and_unknown_ones_before_them() -> None:
    from lmgeo.core.execution import _longest_first

    def batch(*times: float | None) -> list[Shard]:
        return [Shard(f"{t}-{i}", square, expected_s=t) for i, t in enumerate(times)]

    batches = [batch(5.0), batch(1.0, 2.0), batch(None), batch(40.0), batch(3.0), batch(2.0, None), batch(3.0)]
    order = [[s.expected_s for s in b] for b in _longest_first(batches)]
    # unknown first in plan order; known by their total, longest first; ties in plan order (three of 3 s)
    assert order == [[None], [2.0, None], [40.0], [5.0], [1.0, 2.0], [3.0], [3.0]]
    tied = [b for b in _longest_first(batches) if sum(s.expected_s or 0 for s in b) == 3.0]
    assert [id(b) for b in tied] == [id(batches[1]), id(batches[4]), id(batches[6])]


@pytest.mark.slow  # the session's embedded Ray
def test_the_longest_shards_run_first(ray_local) -> None:
    times = [1.0, 30.0, None, 25.0, 2.0]
    shards = [Shard(f"s{i}", square, (i,), expected_s=t) for i, t in enumerate(times)]
    # One task in flight at a time: results arrive in the order the tasks were submitted.
    results = run_shards(shards, ONE_CPU, max_in_flight=1, max_retries=0, label="sq", shards_per_task=8)
    assert list(results) == ["s2", "s1", "s3", "s4", "s0"] and results["s3"] == 9
