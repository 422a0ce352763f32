"""The tcp transport's peer authentication: a shared secret per deployment and its HMACs.

The secret. One random secret per deployment (``new_secret``: 32 random bytes, hex), created
by the front-end in a private directory (``host.private_dir``: mode 0700) as a file of mode
0600, whose *path* every process of the deployment gets as ``VLLM_AFD_AUTH_FILE``: the engine
cores and workers inherit it from the front-end's environment, the FFN ranks get it in their
Ray runtime environment. The secret itself is never in the environment (``/proc/PID/environ``),
the Ray metadata (runtime environments and actor arguments are stored in the GCS, readable by
any holder of the cluster's token), the ``TransportSpec`` (``VLLM_AFD_RUNTIME``) or a command
line; only processes of this user on a host that has the file can read it. FFN ranks on other
hosts (``--afd-ray-address`` with the tcp transport) need the same file there: the operator
provisions it (e.g. a Kubernetes secret mounted read-only) and sets ``VLLM_AFD_AUTH_FILE`` to
its path on every host; the front-end then uses it instead of creating one. A file that is not
the user's own regular file closed to group and others (0600 or 0400), or holds fewer than
``MIN_SECRET_BYTES``, is refused (``load_secret``).

The handshake (``tcp.py``), at connect only, so the data path costs nothing more:

    FFN -> attention   CHALLENGE  nonce_f (32 random bytes, fresh per connection)
    attention -> FFN   HELLO      layout fields | nonce_a | hello_mac(nonce_f, fields, nonce_a)
    FFN -> attention   WELCOME    welcome_mac(nonce_f, fields, nonce_a)   or REJECT reason

The FFN rank accepts a HELLO only with a valid MAC over its own fresh nonce, so a HELLO recorded
from another connection (replayed) or built without the secret (forged) is refused, before any
buffer is allocated or a live connection of that attention rank is touched. The attention rank
accepts the FFN rank only with a valid WELCOME (mutual: a process that took over the FFN rank's
port cannot collect hidden states). HMAC-SHA256, compared in constant time. Traffic is not
encrypted: across hosts, hidden states cross the network in plaintext (use a private network or
an encrypted overlay).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from vllm_afd import envs
from vllm_afd.errors import AFDConfigError
from vllm_afd.host import read_private_file

NONCE_BYTES = 32
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
_HELLO_LABEL = b"vllm-afd tcp hello v3\0"
_WELCOME_LABEL = b"vllm-afd tcp welcome v3\0"


def new_secret() -> bytes:
    """A fresh secret (the content of a new ``VLLM_AFD_AUTH_FILE``)."""
    return secrets.token_hex(32).encode()


def load_secret(path: str | None = None) -> bytes:
    """The deployment's secret from ``path`` (default: ``VLLM_AFD_AUTH_FILE``).

    Raises:
        AFDConfigError: naming the variable, if it is unset, unreadable, not this user's
            private file, or too short.
    """
    path = path or envs.VLLM_AFD_AUTH_FILE
    if not path:
        raise AFDConfigError(
            f"{envs.AUTH_FILE} is unset: the tcp transport needs the deployment's shared "
            "secret (the front-end creates it; FFN ranks on other hosts need the same file, "
            f"mode 0600, and {envs.AUTH_FILE} set to its path)"
        )
    try:
        secret = read_private_file(path).strip()
    except OSError as exc:
        raise AFDConfigError(
            f"{envs.AUTH_FILE}={path!r}: cannot use it as the tcp transport's shared secret "
            f"({exc}); expected this user's own file of mode 0600 holding at least "
            f"{MIN_SECRET_BYTES} bytes"
        ) from None
    if len(secret) < MIN_SECRET_BYTES:
        raise AFDConfigError(
            f"{envs.AUTH_FILE}={path!r}: {len(secret)} bytes; the shared secret must hold at "
            f"least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return secret


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def hello_mac(secret: bytes, ffn_nonce: bytes, fields: bytes, attention_nonce: bytes) -> bytes:
    """What the attention rank proves with its HELLO: the secret, over the FFN rank's nonce."""
    message = _HELLO_LABEL + ffn_nonce + fields + attention_nonce
    return hmac.new(secret, message, hashlib.sha256).digest()


def welcome_mac(secret: bytes, ffn_nonce: bytes, fields: bytes, attention_nonce: bytes) -> bytes:
    """What the FFN rank proves with its WELCOME: the secret, over the attention rank's nonce."""
    message = _WELCOME_LABEL + attention_nonce + ffn_nonce + fields
    return hmac.new(secret, message, hashlib.sha256).digest()


def verify(expected: bytes, received: bytes) -> bool:
    return hmac.compare_digest(expected, bytes(received))
