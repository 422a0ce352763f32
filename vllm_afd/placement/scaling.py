"""Placement, scaling: change the number of FFN ranks while the deployment serves
(``POST /afd/scale``, ``placement/routes.py``).

The shape follows vLLM's elastic expert parallelism (``/scale_elastic_ep``): one admin request
sets the new size and answers once the deployment serves on it. Here the attention ranks keep
everything they hold (KV cache, scheduler, requests in flight); only the FFN pool changes:

1. the new pool starts next to the running one: ``N`` FFN ranks in a placement group of their
   own, each loading its slice of the experts (contiguous placement over ``N``), with an FFN
   directory (and a failover supervisor) of its own, while the old pool serves;
2. the front-end adopts it as its group (``lifecycle.adopt``: refused when the front-end
   stopped meanwhile, and the scale stops it, 503) and publishes it as the next *epoch* of
   the deployment's pool (``directory.Pool``);
3. every attention rank switches to it at a step boundary (``AttentionSession.switch_pending``,
   attention/session.py): the steps before run entirely on the old pool, the steps after
   entirely on the new one, so a request in flight gets the tokens it would have had (same
   experts, same inputs; only the order of the sum over FFN ranks changes, as between two
   ratios);
4. once every attention rank said so (``directory.Switch``), the old pool drains (nothing is
   in flight on it any more) and stops.

Why no common step for every attention rank: FFN ranks that serve requests as they come
(``transport.base.ServesRequests``: the slot plane on host memory and NIXL) serve whatever arrives,
from any attention rank, so two attention ranks on two pools for a step is correct, and a rank
idle for minutes never holds a scale up. FFN ranks that serve whole steps of every attention
rank at once (the slot plane with the device's waits, every GPU) cannot scale live yet
(``Feature.LIVE_SCALING``): there the switch needs one step number at which every attention
rank changes pools (announced like a schedule), so that no FFN rank waits for a rank that
left; each attention rank then maps the new pool's buffers and unmaps the old ones.

An ffn-server group (``shared.py``) has no HTTP server: ``vllm-afd scale GROUP_FILE N`` drops
a request file into the group's private scale directory (0700, named in the group file), and
the ffn-server answers it next to it (``request_scale``, ``answer_scale_requests``). Only the
user who runs the group can reach it, as only they can read the group file; nothing listens.
The scale waits for the attention ranks front-ends hold (``shared.served_attention_ranks``);
a front-end joining later joins the live pool (``pool.json``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from vllm_afd.errors import AFDConfigError
from vllm_afd.placement import lifecycle, shared
from vllm_afd.placement.cluster import FFNGroup
from vllm_afd.transport import Feature, TransportSpec, backend, directory

logger = logging.getLogger("vllm.afd")
#: How long a scale waits for every attention rank to switch to the new pool (a rank switches
#: before its next step; an idle one within ``attention.session.POOL_POLL_S``).
SWITCH_TIMEOUT_S = 60.0


class ScaleError(Exception):
    """A scale that was refused or did not complete; ``status`` is the HTTP status to answer
    (400: a count the experts cannot split into; 409: this deployment cannot scale now; 503:
    the new pool did not start; 504: an attention rank did not switch in time)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ScaleEvent:
    """One completed scale: pool ``epoch`` of ``to_ranks`` FFN ranks replaced ``from_ranks``;
    ``took_s`` from the request to the old pool stopped; ``stall_s``, the longest an attention
    rank's step waited for its switch (connecting to the new ranks)."""

    epoch: int
    from_ranks: int
    to_ranks: int
    at: float  # time.time() of the request
    took_s: float
    stall_s: float


_SCALING = threading.Lock()
#: The scale under way (``in_progress``), held with ``_SCALING``.
_UNDER_WAY: dict[str, Any] | None = None


def in_progress() -> dict[str, Any] | None:
    """The scale under way (``from_ranks``, ``to_ranks``, ``since``: its request's unix time),
    or ``None``: ``/afd/status`` shows it, so a scale whose client gave up is still seen."""
    return _UNDER_WAY


def check_count(group: FFNGroup, num_ffn_ranks: object) -> int:
    """``num_ffn_ranks`` as a valid FFN rank count for ``group``'s model, or ``ScaleError``
    (400) naming the field and what is allowed."""
    experts = group.spec.num_experts
    allowed = [n for n in range(1, experts + 1) if experts % n == 0]
    if isinstance(num_ffn_ranks, _LongInteger):
        raise ScaleError(
            400, f"num_ffn_ranks: an integer of {num_ffn_ranks.digits} digits; one of {allowed}"
        )
    if isinstance(num_ffn_ranks, bool) or not isinstance(num_ffn_ranks, int):
        raise ScaleError(
            400, f"num_ffn_ranks must be an integer, one of {allowed}, not {num_ffn_ranks!r:.40}"
        )
    try:
        if num_ffn_ranks < 1:
            raise AFDConfigError(f"{num_ffn_ranks} FFN ranks")
        assert group.request is not None
        group.request.model.check_ffn_ranks(num_ffn_ranks)
    except AFDConfigError as exc:
        reason = str(exc).split(": ", 1)[-1]
        raise ScaleError(
            400,
            f"num_ffn_ranks {num_ffn_ranks}: {reason}; the model's {experts} routed "
            f"experts split into {allowed} FFN ranks",
        ) from None
    return num_ffn_ranks


def scale_ffn_group(
    num_ffn_ranks: object, switch_timeout_s: float = SWITCH_TIMEOUT_S
) -> ScaleEvent | None:
    """Serve on ``num_ffn_ranks`` FFN ranks from now on (see the module docstring); returns the
    completed scale, ``None`` when the pool has that size already.

    Raises:
        ScaleError: refused (400, 409) or not completed (503, 504: the message says what
            still runs).
    """
    global _UNDER_WAY
    if not _SCALING.acquire(blocking=False):
        raise ScaleError(409, "another scale of the FFN pool is in progress")
    try:
        old = lifecycle.current_group()
        if old is None or old.request is None:
            joined = (
                ""
                if shared._LEASES is None
                else (
                    ": this front-end joined a group of `vllm-afd ffn-server`: `vllm-afd scale` it"
                )
            )
            raise ScaleError(409, f"no FFN group of this front-end to scale{joined}")
        spec = old.spec
        if Feature.LIVE_SCALING not in backend(spec.backend).features(spec.config):
            raise ScaleError(
                409, f"--afd-transport {old.spec.backend} cannot change its FFN pool live"
            )
        count = check_count(old, num_ffn_ranks)
        if count == old.spec.num_ffn_ranks:
            return None
        _UNDER_WAY = {"from_ranks": spec.num_ffn_ranks, "to_ranks": count, "since": time.time()}
        return _scale(old, count, switch_timeout_s)
    finally:
        _UNDER_WAY = None
        _SCALING.release()


def _scale(old: FFNGroup, count: int, switch_timeout_s: float) -> ScaleEvent:
    at, start = time.time(), time.monotonic()
    request = old.request
    assert request is not None
    afd, spec = request.afd, old.spec
    published = directory.read_pool(spec.directory)
    epoch = (published.epoch if published else 1) + 1
    launch = dataclasses.replace(
        old.launch,
        num_ffn_ranks=count,
        directory=lifecycle._ffn_directory(epoch),
    )
    logger.info(
        "AFD: scaling the FFN pool from %d to %d rank(s) (pool %d)",
        spec.num_ffn_ranks,
        count,
        epoch,
    )
    try:
        new = lifecycle._launch(launch, afd, request.model_dir, request.device)
    except Exception as exc:  # noqa: BLE001 - the old pool serves on
        raise ScaleError(503, f"the new pool of {count} FFN rank(s) did not start: {exc}") from None
    new.request = request
    lifecycle.supervise(new)
    # /afd/status, /metrics and /health see the new pool from now on
    if not lifecycle.adopt(new, replacing=old):
        lifecycle.stop_pool(new)
        raise ScaleError(503, "the front-end stopped its FFN group while the new pool started")
    events = published.events if published else ()
    directory.publish_pool(spec.directory, directory.Pool(epoch, new.spec.to_json(), events))
    switched = _wait_for_switches(spec, epoch, switch_timeout_s)
    if switched is None:
        threading.Thread(
            target=_drain_later, args=(old, epoch), name="afd-pool-drain", daemon=True
        ).start()
        raise ScaleError(
            504,
            f"not every attention rank switched to the new pool within {switch_timeout_s:g}s; "
            "the old pool serves the ones that did not and stops once they have",
        )
    lifecycle.stop_replaced(old)
    event = ScaleEvent(
        epoch,
        spec.num_ffn_ranks,
        count,
        at,
        time.monotonic() - start,
        max((s.stall_s for s in switched), default=0.0),
    )
    directory.publish_pool(
        spec.directory,
        directory.Pool(epoch, new.spec.to_json(), (*events, dataclasses.asdict(event))),
    )
    logger.info(
        "AFD: FFN pool scaled from %d to %d rank(s) in %.1fs (pool %d; the longest switch held "
        "a step %.1f ms)",
        event.from_ranks,
        event.to_ranks,
        event.took_s,
        epoch,
        event.stall_s * 1e3,
    )
    return event


def _wait_for_switches(
    spec: TransportSpec, epoch: int, timeout_s: float
) -> list[directory.Switch] | None:
    """The switch to pool ``epoch`` of every attention rank serving on ``spec``'s pool
    (``None`` after ``timeout_s``). Of an ffn-server group, the ranks front-ends hold, looked up
    each poll: one that leaves meanwhile is not waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = directory.switches(spec.directory, shared.served_attention_ranks(spec))
        if all(s is not None and s.epoch >= epoch for s in found):
            return found  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            return None
        time.sleep(directory.POLL_S)


def _drain_later(old: FFNGroup, epoch: int) -> None:
    while old in lifecycle.DRAINING:
        if _wait_for_switches(old.spec, epoch, 1.0) is not None:
            lifecycle.stop_replaced(old)
            return


#: The most bytes a scale request may have (``{"num_ffn_ranks": N}`` is 20).
REQUEST_MAX_BYTES = 4096
#: The most digits of an integer in a scale request (Python refuses past 4,300).
_MAX_DIGITS = 18
_SHAPE = 'the body is the JSON object {"num_ffn_ranks": N}'


@dataclass(frozen=True)
class _LongInteger:
    """An integer of ``digits`` digits, too long to be a count (``parse_body``)."""

    digits: int


def parse_body(raw: bytes) -> object:
    """The FFN rank count a scale request ``raw`` asks for (checked by ``check_count``), or
    ``ScaleError`` (400) saying what is wrong with the body: its size, its JSON, its shape, a
    field that is not ``num_ffn_ranks`` (named), an integer too long to parse."""
    if len(raw) > REQUEST_MAX_BYTES:
        raise ScaleError(
            400, f"the body has {len(raw)} bytes, at most {REQUEST_MAX_BYTES}; {_SHAPE}"
        )

    def integer(text: str) -> int | _LongInteger:
        digits = len(text.lstrip("-"))
        return int(text) if digits <= _MAX_DIGITS else _LongInteger(digits)

    try:
        body = json.loads(raw, parse_int=integer)
    except RecursionError:
        raise ScaleError(400, f"the body nests too deep; {_SHAPE}") from None
    except ValueError as exc:
        raise ScaleError(400, f"the body is not JSON ({exc}); {_SHAPE}") from None
    if not isinstance(body, dict):
        raise ScaleError(400, f"the body is a JSON {type(body).__name__}; {_SHAPE}")
    unknown = sorted(set(body) - {"num_ffn_ranks"})
    if unknown:
        raise ScaleError(400, f"unknown field(s) {unknown}; {_SHAPE}")
    if "num_ffn_ranks" not in body:
        raise ScaleError(400, f"num_ffn_ranks is missing; {_SHAPE}")
    return body["num_ffn_ranks"]


def answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    """Carry out one scale request ``raw`` (JSON ``{"num_ffn_ranks": N}``, from ``POST
    /afd/scale`` or ``vllm-afd scale``): (HTTP status, the JSON answer)."""
    try:
        event = scale_ffn_group(parse_body(raw))
    except ScaleError as exc:
        return exc.status, {"error": str(exc)}
    group = lifecycle.current_group()  # the process that scaled holds the group
    assert group is not None
    return 200, {
        "num_ffn_ranks": group.spec.num_ffn_ranks,
        "ratio": group.spec.ratio,
        "scale": None if event is None else dataclasses.asdict(event),
    }


#: How often ``vllm-afd ffn-server`` looks for a scale request (``answer_scale_requests``).
REQUEST_POLL_S = 0.2
_REQUEST, _ANSWER = ".request", ".answer"


def answer_scale_requests(requests_dir: str) -> int:
    """Carry out the scale requests waiting in ``requests_dir``, oldest first, one at a time,
    each answered in a file of its own next to it; returns how many."""
    from vllm_afd.host import read_private_file, write_private_file

    waiting = []
    for name in os.listdir(requests_dir):
        path = os.path.join(requests_dir, name)
        if name.endswith(_REQUEST):
            try:
                waiting.append((os.stat(path).st_mtime_ns, path))
            except FileNotFoundError:
                pass
    for _, path in sorted(waiting):
        try:
            raw = read_private_file(path, REQUEST_MAX_BYTES)
        except OSError:
            raw = b""  # not a request of this user: refused as any bad body
        finally:
            os.unlink(path)
        try:
            status, content = answer(raw)
        except Exception as exc:  # noqa: BLE001 - the group serves on; the asker is told
            logger.exception("AFD: a scale request failed")
            status, content = 500, {"error": f"the scale failed: {exc}"}
        reply = path.removesuffix(_REQUEST) + _ANSWER
        write_private_file(reply + ".tmp", json.dumps({"status": status, **content}).encode())
        os.replace(reply + ".tmp", reply)  # the asker reads it whole once it exists
    return len(waiting)


def request_scale(group_file: str, num_ffn_ranks: int, timeout_s: float) -> dict[str, Any]:
    """Ask the ffn-server of ``group_file`` for ``num_ffn_ranks`` FFN ranks and wait for its
    answer (``answer``'s JSON with ``status``); ``ScaleError`` (504) if none came within
    ``timeout_s``, the request withdrawn unless the server took it already."""
    from vllm_afd.host import read_private_file, write_private_file

    content = shared.read_group_file(group_file, f"vllm-afd scale {group_file!r}")
    requests_dir = content.get("scale_requests")
    if not requests_dir:
        raise AFDConfigError(
            f"vllm-afd scale {group_file!r}: the group's ffn-server takes no scale requests "
            "(an older vllm-afd); restart it"
        )
    base = os.path.join(str(requests_dir), uuid.uuid4().hex)
    write_private_file(base + _REQUEST, json.dumps({"num_ffn_ranks": num_ffn_ranks}).encode())
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(base + _ANSWER):
        if time.monotonic() >= deadline:
            try:
                os.unlink(base + _REQUEST)
                taken = ""
            except FileNotFoundError:
                taken = "; it took the request and may still carry it out"
            raise ScaleError(504, f"the ffn-server did not answer within {timeout_s:g}s{taken}")
        time.sleep(REQUEST_POLL_S)
    try:
        return json.loads(read_private_file(base + _ANSWER, 1 << 16))
    finally:
        os.unlink(base + _ANSWER)


def events(ffn_directory: str) -> list[dict]:
    """The deployment's completed scales (``ScaleEvent`` dicts, oldest first)."""
    pool = directory.read_pool(ffn_directory) if ffn_directory else None
    return list(pool.events) if pool else []
