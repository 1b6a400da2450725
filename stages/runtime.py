"""Connecting the CLI to Ray: the only place in lmgeo that calls ``ray.init`` (SPEC §1).

Worker processes import ``pipeline`` and ``stages`` as the driver imported them: Ray ships both
packages to every node (``runtime_env`` ``py_modules``; a node needs the installed dependencies, not the
checkout), and puts them first on the workers' ``sys.path``. The workspace itself (``data/``) never
travels that way: tasks get their inputs through the object store (``pipeline.core.execution``).
"""

from __future__ import annotations

import logging
import os

from pipeline.core.config import RayConfig
from pipeline.core.errors import InputError

# Environment every task's worker gets, also on cluster nodes that did not inherit the driver's.
WORKER_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def worker_runtime_env() -> dict:
    """What every worker of lmgeo's Ray job gets: the project's packages as the driver imports them (the
    code version check in each task compares what they hash to with the plan) and `WORKER_ENV`."""
    import pipeline
    import stages

    return {"py_modules": [pipeline, stages], "excludes": ["__pycache__"], "env_vars": WORKER_ENV}


def resolve_address(cfg: RayConfig, address: str | None = None) -> str | None:
    """The cluster to join: ``--ray-address``, then ``RAY_ADDRESS``, then ``ray.address`` in params.

    ``None`` means: start an embedded local Ray.
    """
    return address or os.environ.get("RAY_ADDRESS") or cfg.address or None


def check_reachable(cfg: RayConfig, address: str | None = None) -> None:
    """Fail within `ray.connect_timeout_s`, naming the address, when the cluster to join does not answer
    (Ray itself would retry for minutes). Called before a stage changes anything."""
    import socket

    target = resolve_address(cfg, address)
    if target is None or target == "auto":
        return
    host, _, port = target.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=cfg.connect_timeout_s):
            return
    except (OSError, ValueError) as err:
        raise InputError(
            f"cannot reach the Ray cluster at {target!r} ({err}); start it (`ray start --head` on its head node) "
            "or fix --ray-address / RAY_ADDRESS / ray.address"
        ) from None


def start_ray(cfg: RayConfig, address: str | None = None) -> None:
    """Join the cluster named by ``resolve_address``, or start an embedded local Ray. Idempotent."""
    import ray

    if ray.is_initialized():
        return
    # Ray would otherwise try to report usage over the network, which the target machines lack.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    target = resolve_address(cfg, address)
    if target is not None:
        join_cluster(target)
        return
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
