"""S4: vLLM's master TCPStore for a loopback host listens on that host only (a TCPStore master
left to itself binds every interface)."""

from __future__ import annotations

import os

import psutil
import pytest


def _listening(port: int) -> set[str]:
    """The addresses this process listens on at ``port``."""
    return {
        c.laddr.ip
        for c in psutil.Process(os.getpid()).net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


@pytest.fixture(scope="module")
def create_tcp_store():
    import vllm_afd

    vllm_afd.register()
    from vllm.distributed import parallel_state

    return parallel_state.create_tcp_store


def test_a_loopback_master_store_listens_on_loopback_only(create_tcp_store):
    store = create_tcp_store("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    assert store.port > 0 and _listening(store.port) == {"127.0.0.1"}
    store.set("k", b"v")
    client = create_tcp_store("127.0.0.1", store.port, is_master=False, world_size=1)
    assert client.get("k") == b"v"


def test_the_stock_store_would_listen_everywhere(create_tcp_store):
    """What S4 fixes, so that the test above can fail: the unpatched function binds ``::``."""
    stock = create_tcp_store.__wrapped__
    store = stock("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    assert _listening(store.port) - {"127.0.0.1"}, _listening(store.port)


def test_loopback_addresses():
    from vllm_afd.host import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert is_loopback("fe80::1%lo") is False and is_loopback("127.0.0.2%eth0")
    assert not is_loopback("10.0.0.1") and not is_loopback("localhost") and not is_loopback("::")
