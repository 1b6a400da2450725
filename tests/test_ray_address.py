"""The cluster address a stage joins: refused in one line, within `ray.connect_timeout_s`, when it is a Ray Client
address or a port that does not answer as Ray's GCS (no Ray is started here)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from lmgeo.core.config import RayConfig
from lmgeo.core.errors import InputError
from lmgeo.driver.runtime import check_reachable


def test_a_ray_client_address_is_refused_naming_what_to_give() -> None:
    with pytest.raises(InputError) as refused:
        check_reachable(RayConfig(), "ray://head:10001")
    assert str(refused.value) == (
        "'ray://head:10001': Ray Client addresses (ray://) are not supported; run lmgeo on a node of the cluster "
        "and give its GCS address, `host:6379` (what `ray start --head` printed), or `auto`"
    )


@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_a_listening_port_that_is_not_rays_is_refused_within_the_time_out(answer: bytes | None) -> None:
    """A port that accepts and says nothing, or answers another protocol: refused after at most
    `connect_timeout_s`, not a stage waiting on it with no time-out."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        if answer is not None:
            server.settimeout(5)

            def reply() -> None:
                conn, _ = server.accept()
                with conn:
                    conn.sendall(answer)

            threading.Thread(target=reply, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(InputError) as refused:
            check_reachable(RayConfig(connect_timeout_s=0.5), address)
        took = time.monotonic() - started
    assert str(refused.value) == (
        f"{address!r} answers, but not as a Ray cluster's GCS (within 0.5 s); give the address `ray start --head` "
        "printed (`host:6379`), or fix --ray-address / RAY_ADDRESS / ray.address"
    )
    assert took < 3.0, took
