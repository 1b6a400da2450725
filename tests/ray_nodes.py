"""Ray nodes started as a user starts them (`ray start … --block`), for the tests that join a real cluster
(tests/test_execution.py, tests/test_cluster.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(cmd: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`cmd` (a `ray start … --block`) in its own session, its output going to `log`; returns once Ray says
    the node runs (or fails naming the log)."""
    with open(log, "w") as out:
        node = subprocess.Popen(list(cmd), env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "Ray runtime started." not in log.read_text():
        if node.poll() is not None or time.monotonic() > deadline:
            stop_process_group(node)
            raise AssertionError(f"{' '.join(cmd)} failed:\n{log.read_text()}")
        time.sleep(0.2)
    return node


def stop_process_group(proc: subprocess.Popen) -> None:
    """Stop `ray start --block` and the Ray processes it started (its own session, nobody else's).

    SIGTERM to `ray start` alone drains the node and stops its processes in seconds; the same signal
    to the whole group makes each process drain on its own (~30 s). SIGKILL then ends any leftover
    of the group (our own session: `start_new_session=True`).
    """
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
