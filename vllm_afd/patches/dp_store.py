"""Worker, S4: the data-parallel world group's store listens on loopback only (ledger in
``__init__``).

With data parallelism on one node (what ``--afd-ratio A:F`` gives a server: A data-parallel
attention ranks), vLLM's ``init_distributed_environment`` lets global rank 0 create the world
group's ``TCPStore`` with ``create_tcp_store(data_parallel_master_ip, 0, is_master=True)``, and
a ``TCPStore`` master binds every interface whatever host it is given: worker DP0 listened on
``::``, with no authentication, while every client connects to ``127.0.0.1``. vLLM's own
``create_tcp_store`` takes a pre-bound ``listen_socket`` (its coordination store uses one);
this patch gives it one bound to the loopback address the workers connect to. Any other host
(a multi-node deployment) is left as vLLM has it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from vllm_afd.host import is_loopback
from vllm_afd.patches.base import wrap


def loopback_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host`` (an IPv4 or IPv6 loopback address), ``port`` 0:
    any free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def _create_tcp_store(original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(host: str, port: int, listen_socket=None, **kwargs: Any):
        if listen_socket is None and kwargs.get("is_master") and is_loopback(host):
            listen_socket = loopback_listener(host, port)
            port = listen_socket.getsockname()[1]
        return original(host, port, listen_socket, **kwargs)

    return wrapper


def apply() -> None:
    wrap("S4", _create_tcp_store)
