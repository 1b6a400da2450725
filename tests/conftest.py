"""Shared fixtures.

Ray in the test suite
---------------------
``ray_local`` starts one embedded Ray for the whole session, the way the CLI does
(``lmgeo.driver.runtime.start_ray``), pinned to ``num_cpus=2`` and no GPU whatever the machine has, so
tests behave the same on a laptop, in CI and on a GPU box. It ignores ``RAY_ADDRESS``: tests never
join a cluster by accident.

A process holds one Ray connection at a time. Tests that need another cluster (a two-node
``ray.cluster_utils.Cluster``, a ``ray start --head`` process joined by address) therefore run their
driver in a subprocess and never touch the session's Ray; see ``tests/test_execution.py``.

Task functions defined in test modules are pickled by reference (``test_x.fn``), so Ray workers
must be able to import the test modules: ``tests/`` is put on ``PYTHONPATH`` here, before any Ray
starts, and every Ray process (and any subprocess a test starts) inherits it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

TESTS_DIR = Path(__file__).resolve().parent
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))

RAY_TEST_CPUS = 2


@pytest.fixture(scope="session")
def ray_local() -> Iterator[ModuleType]:
    """The session's embedded Ray (2 CPUs, no GPU); yields the ``ray`` module."""
    import ray

    from lmgeo.core.config import RayConfig
    from lmgeo.driver.runtime import start_ray

    address = os.environ.pop("RAY_ADDRESS", None)
    try:
        start_ray(RayConfig(num_cpus=RAY_TEST_CPUS, num_gpus=0))
    finally:
        if address is not None:
            os.environ["RAY_ADDRESS"] = address
    resources = ray.cluster_resources()
    assert resources.get("CPU") == RAY_TEST_CPUS and not resources.get("GPU"), resources
    yield ray
    ray.shutdown()


# --------------------------------------------------------------------------------- tiny models
# One size for every tiny random-weight model of the suite, built from configs (no download).
TINY_D_MODEL, TINY_LAYERS = 32, 2
VOCAB, SEQ_LEN = 128, 16


def tiny_size():
    from lmgeo.models.config import ModelSize

    return ModelSize(d_model=TINY_D_MODEL, n_layers=TINY_LAYERS, n_heads=4, d_state=8, expand=2)


def trainable_families() -> list[str]:
    from lmgeo.models.registry import FAMILIES

    return [family.name for family in FAMILIES if family.trainable]


@pytest.fixture(scope="module", params=trainable_families())
def arch(request: pytest.FixtureRequest) -> str:
    """Every registered family that can be built from a config: a new family is tested by adding it."""
    return request.param


@pytest.fixture
def tiny_model(arch: str):
    """A tiny random-weight model of `arch` (seed 0), in eval mode."""
    from lmgeo.models.registry import build_model

    return build_model(arch, tiny_size(), VOCAB, SEQ_LEN, seed=0).eval()
