"""Connecting the CLI to Ray: the only place in lmgeo that calls ``ray.init`` (SPEC §1).

Worker processes import ``lmgeo`` as the driver imported it: Ray ships the
package to every node (``runtime_env`` ``py_modules``; a node needs the installed dependencies, not the
checkout), and puts them first on the workers' ``sys.path``. The workspace itself (``data/``) never
travels that way: tasks get their inputs through the object store (``lmgeo.core.execution``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from typing import Any

from lmgeo.core.config import RayConfig
from lmgeo.core.errors import InputError

# Environment every task's worker gets, also on cluster nodes that did not inherit the driver's.
WORKER_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


# Set in the driver before Ray is imported (Ray reads them then). Usage reports would go over the network, which
# the target machines lack. Log deduplication folds worker lines that differ only in their numbers into one
# "[repeated 2x across cluster]": two runs training at once (`train neox-adamw-s0`, `-s1`) would show as one.
DRIVER_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
# Ray's notes to whoever runs a shared cluster, not to a user of lmgeo's embedded one: that token authentication
# is on by default (Ray >= 2.59), a WARNING on every start. Shown with `lmgeo --verbose` (LMGEO_VERBOSE=1).
NOTICE_LOGGERS = ("ray._private.authentication",)
VERBOSE_ENV = "LMGEO_VERBOSE"


def quiet_ray() -> None:
    """Before ``import ray``: set `DRIVER_ENV` (unless the user set them); afterwards `show_notices` says whether
    Ray's start-up notices reach the screen."""
    for name, value in DRIVER_ENV.items():
        os.environ.setdefault(name, value)


def show_notices() -> None:
    """After ``import ray`` (its logging set-up would reset a level set before): Ray's start-up notices only
    for a user who asked for them (`VERBOSE_ENV`)."""
    level = logging.NOTSET if os.environ.get(VERBOSE_ENV) == "1" else logging.ERROR
    for name in NOTICE_LOGGERS:
        logging.getLogger(name).setLevel(level)


def worker_runtime_env() -> dict:
    """What every worker of lmgeo's Ray job gets: the project's package as the driver imports it (the
    code version check in each task compares what they hash to with the plan) and `WORKER_ENV`."""
    import lmgeo

    return {"py_modules": [lmgeo], "excludes": ["__pycache__"], "env_vars": WORKER_ENV}


def resolve_address(cfg: RayConfig, address: str | None = None) -> str | None:
    """The cluster to join: ``--ray-address``, then ``RAY_ADDRESS``, then ``ray.address`` in params.

    ``None`` means: start an embedded local Ray.
    """
    return address or os.environ.get("RAY_ADDRESS") or cfg.address or None


def check_reachable(cfg: RayConfig, address: str | None = None) -> None:
    """Fail within `ray.connect_timeout_s`, naming the address, when the cluster to join does not answer, or
    does not answer as Ray's GCS (a gRPC server: it answers HTTP/2's preface with a SETTINGS frame); Ray itself
    would retry for minutes, or wait with no time-out on a port that is not Ray's. Called before a stage
    changes anything."""
    import socket

    target = resolve_address(cfg, address)
    if target is None or target == "auto":
        return
    _check_not_client(target)
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=cfg.connect_timeout_s) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return  # a TLS GCS answers nothing in plain text
            answer = _first_frame(conn)
    except (OSError, ValueError) as err:
        raise InputError(
            f"cannot reach the Ray cluster at {target!r} ({err}); start it (`ray start --head` on its head node) "
            "or fix --ray-address / RAY_ADDRESS / ray.address"
        ) from None
    if len(answer) < 4 or answer[3] != _SETTINGS:
        raise InputError(
            f"{target!r} answers, but not as a Ray cluster's GCS (within {cfg.connect_timeout_s:g} s); give the "
            "address `ray start --head` printed (`host:6379`), or fix --ray-address / RAY_ADDRESS / ray.address"
        )


# HTTP/2's client preface; a gRPC server (Ray's GCS) answers it with a frame whose type (byte 3) is SETTINGS.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
_SETTINGS = 0x04


def _first_frame(conn: Any) -> bytes:
    """The first bytes (up to a frame header) that `conn` answers HTTP/2's preface with; b"" for none before
    its time-out or end of stream."""
    import socket

    conn.sendall(_HTTP2_PREFACE)
    answer = b""
    with contextlib.suppress(socket.timeout, ConnectionError):
        while len(answer) < 9 and (chunk := conn.recv(9 - len(answer))):
            answer += chunk
    return answer


def _check_not_client(target: str) -> None:
    if target.startswith("ray://"):
        raise InputError(
            f"{target!r}: Ray Client addresses (ray://) are not supported; run lmgeo on a node of the cluster "
            "and give its GCS address, `host:6379` (what `ray start --head` printed), or `auto`"
        )


def start_ray(cfg: RayConfig, address: str | None = None) -> None:
    """Join the cluster named by ``resolve_address``, or start an embedded local Ray. Idempotent."""
    quiet_ray()
    import ray

    if ray.is_initialized():
        return
    show_notices()
    target = resolve_address(cfg, address)
    if target is not None:
        join_cluster(target)
        return
    _reap_when_gone()  # before Ray starts: a driver killed while it starts is reaped too
    try:
        ray.init(
            # "local" starts a new instance even if a `ray start` cluster runs on this machine: joining
            # one is explicit (RAY_ADDRESS / --ray-address / ray.address), never a side effect.
            address="local",
            num_cpus=cfg.num_cpus or os.cpu_count(),
            num_gpus=cfg.num_gpus if cfg.num_gpus is not None else detect_gpus(),
            include_dashboard=False,
            logging_level=logging.WARNING,
            runtime_env=worker_runtime_env(),
        )
    except (TimeoutError, RuntimeError, ConnectionError, OSError) as err:
        raise _not_started(ray, err) from None
    except Exception as err:  # Ray reports a node that did not come up as a bare Exception
        if type(err) is not Exception:
            raise
        raise _not_started(ray, err) from None


def _not_started(ray: Any, err: BaseException) -> InputError:
    """The embedded Ray did not come up: what it said, and what to do."""
    ray.shutdown()  # whatever part of it did start
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return InputError(
        f"the embedded Ray did not start ({type(err).__name__}: {first}); the machine may be short of memory or "
        "of space in /dev/shm or /tmp, or a stale Ray of yours may hold them (`ray stop` stops every Ray of yours "
        "on this machine): free them and retry, or join a running cluster with --ray-address"
    )


# Every process the embedded Ray of a driver starts inherits this variable (set in the driver before Ray
# starts), valued `<driver pid>-<random>`: one way the driver's reaper finds them once the driver is gone.
RAY_OWNER_ENV = "LMGEO_RAY_OWNER"
REAPER_POLL_S = 0.25
_reaper: list[subprocess.Popen] = []  # this driver's reaper (one per process: `start_ray` starts Ray once)


def _reap_when_gone() -> None:
    """Start a reaper (`python -P -m lmgeo.driver.runtime <token>`) that ends every process this driver's embedded Ray
    starts once the driver is gone: Ray's own shutdown runs only on a clean exit, and a SIGKILLed driver leaves
    Ray's agents running for good. The reaper reads a pipe only the driver holds open (Python opens it
    non-inheritable, so no Ray process keeps it): its end of file is the driver's end, however it ended."""
    import secrets

    if _reaper:
        return
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    _reaper.append(
        subprocess.Popen(
            # -P: this module as the driver imported it, never a copy in the working directory
            [sys.executable, "-P", "-m", "lmgeo.driver.runtime", token],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the driver's process group: Ctrl-C spares it
        )
    )
    os.environ[RAY_OWNER_ENV] = token  # after the reaper started: it is not one of them


def reap(token: str, poll_s: float = REAPER_POLL_S) -> None:
    """The reaper: while the driver lives (until end of file on stdin), record its descendants (Ray's agents
    are re-parented, and rename themselves, when the node they belong to dies); then end those still running
    and every process of this user that inherited `token`: SIGTERM, then SIGKILL. A process is taken by pid and
    start time, so a pid reused meanwhile is never taken for one of them."""
    import threading

    import psutil

    driver = int(token.split("-")[0])
    gone = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.buffer.read()
        gone.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    seen: dict[int, float] = {}
    while not gone.wait(poll_s):
        with contextlib.suppress(psutil.Error):
            seen |= {child.pid: child.create_time() for child in psutil.Process(driver).children(recursive=True)}
    left = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            ours = seen.get(process.pid) == process.create_time() or process.environ().get(RAY_OWNER_ENV) == token
            if ours and process.pid != os.getpid():
                left.append(process)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(left, timeout=2)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def join_cluster(target: str) -> None:
    """Join a running cluster. A `ray start` cluster authenticates with a token (Ray ≥ 2.59 enables it by
    default): unless `RAY_AUTH_MODE` says otherwise, lmgeo joins in token mode, with the token from
    `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token` (a token-mode client also joins a
    cluster without authentication); a missing token is one error saying what to set."""
    import ray
    from ray.exceptions import AuthenticationError

    if "RAY_AUTH_MODE" not in os.environ:
        # Ray reads the mode into its cached config when it is imported; its own switch refreshes that
        # cache too (a private helper, pinned with Ray's version in constraints.txt).
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    _check_not_client(target)
    try:
        ray.init(address=target, logging_level=logging.WARNING, runtime_env=worker_runtime_env())
    except AuthenticationError as err:
        raise InputError(
            f"cannot join the Ray cluster at {target!r}: {str(err).splitlines()[0]} Give it the cluster's token "
            "(`ray get-auth-token` on the head node) as RAY_AUTH_TOKEN, or set RAY_AUTH_MODE=disabled for a "
            "cluster started without authentication"
        ) from None
    except ConnectionError as err:
        raise InputError(f"cannot join the Ray cluster at {target!r}: {err}") from None


def detect_gpus() -> int:
    import torch  # lazily: `lmgeo --help` and CPU-only stages must not pay for importing torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if __name__ == "__main__":
    reap(sys.argv[1])
