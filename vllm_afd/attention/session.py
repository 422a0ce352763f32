"""One attention worker's connection to the FFN group, and all the state that lives with it.

nano-vllm keeps a step's state in one context object its model runner sets and resets; here that
object is ``AttentionSession``, one per attention worker, opened explicitly when vLLM's worker
loads the model (patch W4: ``open_session``), before any layer runs. It owns

* the transport endpoint (``transport/endpoint.py``) and this rank's /metrics block,
* the step announcer (``attention/steps.py``), the step lock the runner holds for a step and
  the decode step periods it times (``StepPeriods``),
* the model runner of the current step and the requests an FFN error failed
  (``attention/failures.py``),
* on a live-scaling deployment, the pool watcher and the switch to a new FFN pool at a step
  boundary (``PoolWatcher``, ``switch_pending``).

Patches and the routing-boundary op reach it through ``current()`` and call its methods; no
other module writes its state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from vllm_afd import envs
from vllm_afd.attention.failures import Failures
from vllm_afd.attention.steps import Steps, dbo_ubatches, forward_context
from vllm_afd.errors import StepsFailed
from vllm_afd.metrics import recorder
from vllm_afd.metrics.blocks import AttentionStatsBlock
from vllm_afd.transport import (
    AttentionTransport,
    Feature,
    TransportSpec,
    backend,
    create_attention_transport,
    directory,
)

logger = logging.getLogger("vllm.afd")

#: How often an attention rank looks for a new FFN pool (``pool.json``; a ``stat`` call).
POOL_POLL_S = 0.05
#: Steps whose requests a session remembers (a failure is seen at most two steps late).
STEPS_KEPT = 4


class StepPeriods:
    """The period of each decode step, from its start to the next step's start (the engine's
    whole loop: schedule, forward, sampling, output), recorded when that next step decodes too
    (the engine ran on without a pause: only a step that adds requests follows an idle
    engine). The planner's CPU step model predicts this period (``vllm-afd profile`` fits it
    from the engine's step times); the planner in the loop reads it (``placement.autoscale``)."""

    def __init__(self, record: Callable[[float, int, int], None]) -> None:
        #: ``record(seconds, requests, context tokens)`` of each period.
        self.record = record
        self._last: tuple[float, tuple[int, int] | None] = (0.0, None)

    def started(self, at: float, decode: tuple[int, int] | None) -> None:
        """A step started at ``at`` (``time.perf_counter()``); ``decode``: its requests and
        context tokens if it only decodes (``None``: a prefill, a mixed or an empty step)."""
        (then, previous), self._last = self._last, (at, decode)
        if previous is not None and decode is not None:
            self.record(at - then, *previous)


@dataclasses.dataclass
class AttentionSession:
    """An attention worker's connection to the FFN group (see the module docstring)."""

    #: The ``VLLM_AFD_RUNTIME`` text it was opened from (the running group).
    key: str
    endpoint: AttentionTransport
    tp_rank: int
    tp_size: int
    #: This rank's /metrics block (None if it could not be created: metrics never break serving).
    stats: AttentionStatsBlock | None
    steps: Steps
    failures: Failures = dataclasses.field(default_factory=Failures)
    #: The model runner of the step running (W1): a failed batch's requests and rows.
    runner: object | None = None
    #: Held by the model runner for a whole step or dummy run (W1, W3): a live scale switches
    #: an idle rank between steps only. Reentrant: a dummy run may run inside a runner call.
    step_lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    #: The FFN pool it serves on (1: the one the front-end started).
    epoch: int = 1
    #: A newer pool to switch to at the next step boundary, and the endpoint already connected
    #: to its FFN ranks (``connect_ahead``, run by ``PoolWatcher``).
    pending: tuple[directory.Pool, AttentionTransport] | None = None
    watcher: PoolWatcher | None = None
    #: The requests of the runner's step (W1; ``None`` until a step gave them), and of each of
    #: the last ``STEPS_KEPT`` steps announced, by number: a failure the device's waits
    #: recorded fails the requests of the steps it may have spoiled (``begin_step``).
    batch: frozenset[str] | None = None
    step_requests: dict[int, frozenset[str] | None] = dataclasses.field(default_factory=dict)
    _switching: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _closed: bool = False

    def __post_init__(self) -> None:
        #: Decode step periods, into this rank's block (W1 calls ``periods.started``).
        self.periods = StepPeriods(self._record_step)

    def _record_step(self, seconds: float, requests: int, context_tokens: int) -> None:
        if self.stats is not None:
            self.stats.record_step(seconds, requests, context_tokens)

    # -- steps ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, runner: object | None, requests: Iterable[str] | None = None) -> Iterator[None]:
        """A runner step (W1; ``runner`` None for a dummy run, W3): the lock held throughout;
        ``requests``: the step's requests (its scheduler output's), where it has them."""
        with self.step_lock:
            if runner is not None:
                self.runner = runner
            if requests is not None:
                self.batch = frozenset(requests)
            elif runner is None:
                self.batch = frozenset()  # a dummy run serves no request
            yield

    def begin_step(self, microbatch_tokens: Sequence[int], contexts: Sequence[object]) -> None:
        """Begin a step (a step boundary: a pending pool switch happens first). Where the
        device's waits recorded a failure of earlier steps (``StepsFailed``, raised by the
        announcement; a lost FFN rank was replaced first), their requests fail
        (``fail_steps``) and the step is announced again."""
        if self.pending is not None:
            self.switch_pending()
        try:
            self.steps.begin(microbatch_tokens, contexts)
        except StepsFailed as failed:
            errors = self.fail_steps(failed)
            if errors is None:
                raise
            self.failures.requests.update(errors)
            self.steps.begin(microbatch_tokens, contexts)
        self.step_requests[self.endpoint.step] = self.batch
        self.step_requests.pop(self.endpoint.step - STEPS_KEPT, None)

    def fail_steps(self, failed: StepsFailed) -> dict[str, str] | None:
        """The requests of ``failed.steps`` (their outputs may be spoiled), each with its
        cause: the scheduler finishes them with vLLM's error (W1, W2); the others go on.
        ``None`` where a step's requests are unknown (a runner W1 does not wrap): then the
        error must reach vLLM, which fails every request, rather than let spoiled tokens on."""
        requests: set[str] = set()
        for step in failed.steps:
            batch = self.step_requests.get(step)
            if batch is None:
                return None
            requests |= batch
        if not failed.steps:
            return {}  # their requests failed already (``sampled``)
        logger.warning(
            "AFD: attention rank %d: %s; failing the %d request(s) of those steps",
            self.endpoint.rank,
            failed,
            len(requests),
        )
        recorder.record_error(recorder.error_kind(failed.cause), rank=self.endpoint.rank)
        return dict.fromkeys(requests, str(failed.cause))

    def sampled(self, step: int) -> dict[str, str]:
        """W1: the sampled tokens of the runner step that announced ``step`` are ready, its
        device work done (vLLM synchronized on them; with async scheduling on vLLM's output
        thread): the requests to fail with them, where the device's waits recorded a failure
        of that step or an earlier one (``fail_steps``), so that no token of theirs leaves;
        the announcement would see it a step later, or two.

        Raises:
            StepsFailed: where a failed step's requests are unknown (as ``begin_step``).
        """
        try:
            self.endpoint.check_sampled(step)
        except StepsFailed as failed:
            errors = self.fail_steps(failed)
            if errors is None:
                raise
            return errors
        return {}

    def before_dispatch(self, num_tokens: int) -> None:
        """Before a layer's dispatch: begin a step unless this forward's step was begun (by a
        runner patch, or by an earlier layer)."""
        context = forward_context()
        if self.steps.runs_under(context):
            return
        ubatches = dbo_ubatches(self.endpoint.spec.max_tokens)
        if ubatches is not None and any(c is context for c in ubatches[1]):
            self.begin_step(*ubatches)  # the first MoE layer of vLLM's first ubatch (GPUs)
        else:
            self.begin_step((num_tokens,), () if context is None else (context,))

    def take_failed_requests(self) -> dict[str, str]:
        """W1: the requests failed since the last call, with the FFN's error text."""
        return self.failures.take()

    # -- live scaling ---------------------------------------------------------------------

    def connect_ahead(self, pool: directory.Pool) -> None:
        """Connect to ``pool``'s FFN ranks now, outside any step (the pool watcher's thread),
        and make it the pool to switch to at the next step boundary: the switch then only
        swaps endpoints (connecting held the step 25-160 ms over NIXL). A pool whose ranks
        cannot be reached raises here; the watcher logs it and gives the pool up: this rank
        stays on its pool, and the scale that published it times out naming this rank.

        Raises:
            Exception: what connecting raised (the watcher gives the pool up).
        """
        spec = dataclasses.replace(
            TransportSpec.from_json(pool.spec),
            attention_rank_offset=self.endpoint.spec.attention_rank_offset,
        )
        endpoint = create_attention_transport(spec, self.endpoint.rank)
        with self._switching:
            if not self._closed:
                self.pending = (pool, endpoint)
                return
        endpoint.close()  # the session closed meanwhile

    def switch_pending(self) -> None:
        """At a step boundary (no dispatch outstanding): serve on the pending pool from now on,
        and say so (``directory.publish_switch``, with how long the step was held)."""
        with self._switching:
            pending, self.pending = self.pending, None
            if pending is None:
                return
            pool, endpoint = pending
            if pool.epoch <= self.epoch:
                endpoint.close()
                return
            start = time.perf_counter()
            old = self.endpoint
            endpoint.step = old.step  # step numbers keep increasing across pools
            if self.stats is not None:
                self.stats.close()
            self.stats = recorder.endpoint_block(endpoint)
            self.endpoint = self.steps.endpoint = endpoint
            self.epoch = pool.epoch
            old.close()
            stall = time.perf_counter() - start
            spec = endpoint.spec
            directory.publish_switch(spec.directory, directory.Switch(old.rank, pool.epoch, stall))
            logger.info(
                "AFD: attention rank %d serves on FFN pool %d (%d FFN rank(s)) after a %.1f ms "
                "switch",
                old.rank,
                pool.epoch,
                spec.num_ffn_ranks,
                stall * 1e3,
            )

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        with self._switching:
            self._closed = True
            pending, self.pending = self.pending, None
        if pending is not None:
            pending[1].close()
        self.endpoint.close()


class PoolWatcher:
    """A thread of the attention worker that looks for a new FFN pool every ``POOL_POLL_S``
    (a ``stat`` of ``pool.json``), connects to it and hands it to the session for its next
    step boundary (``connect_ahead``), and switches an idle rank itself (one not inside a
    step: the step lock is free), so that a scale completes on a server with no traffic too."""

    def __init__(self, session: AttentionSession) -> None:
        self.session = session
        self.path = directory.pool_path(session.endpoint.spec.directory)
        #: An epoch this rank could not switch to (not tried again).
        self.given_up = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afd-pool-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        session, seen = self.session, None
        while not self._stop.wait(POOL_POLL_S):
            if session.pending is None:
                try:
                    mtime = os.stat(self.path).st_mtime_ns
                except OSError:
                    continue
                if mtime == seen:
                    continue
                seen = mtime
                pool = directory.read_pool(session.endpoint.spec.directory)
                if pool is None or pool.epoch <= max(session.epoch, self.given_up):
                    continue
                try:
                    session.connect_ahead(pool)
                except Exception:  # noqa: BLE001 - serving goes on on the old pool
                    logger.exception(
                        "AFD: attention rank %d cannot switch to FFN pool %d",
                        session.endpoint.rank,
                        pool.epoch,
                    )
                    self.given_up = pool.epoch
                    continue
            if session.step_lock.acquire(timeout=POOL_POLL_S):  # idle: no step runs
                try:
                    session.switch_pending()
                finally:
                    session.step_lock.release()


# --------------------------------------------------------------------------------------------
# This process's session: opened by the worker (W4), read by everything else.
# --------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_SESSION: AttentionSession | None = None


def current() -> AttentionSession | None:
    """This process's attention session; ``None`` in a process without an FFN group."""
    return _SESSION


def open_session() -> AttentionSession:
    """Connect this worker to the deployment's running FFN group (``VLLM_AFD_RUNTIME``).

    Called when the worker loads the model (W4), so a token never pays for it: once per
    process, and again only when the running group changed (another deployment built in the
    same process). Needs vLLM's distributed groups (this rank's place: DP x TP).
    """
    global _SESSION
    key = envs.runtime_json()
    from vllm.distributed.parallel_state import get_dp_group, get_tp_group

    with _LOCK:
        if _SESSION is not None and _SESSION.key == key:
            return _SESSION
        if _SESSION is not None:
            _SESSION.close()
            _SESSION = None
        tp = get_tp_group()
        spec = TransportSpec.from_json(key)
        local = get_dp_group().rank_in_group * tp.world_size + tp.rank_in_group
        endpoint = create_attention_transport(spec, spec.attention_rank_offset + local)
        stats = recorder.endpoint_block(endpoint)
        steps = Steps(endpoint, tp.rank_in_group, tp.world_size)
        session = AttentionSession(key, endpoint, tp.rank_in_group, tp.world_size, stats, steps)
        if spec.directory and Feature.LIVE_SCALING in backend(spec.backend).features(spec.config):
            session.epoch = directory.epoch_of(spec.directory)
            session.watcher = PoolWatcher(session)
        _SESSION = session
        return session


def close_session() -> None:
    """Close this process's session, if any (its endpoint and pool watcher)."""
    global _SESSION
    with _LOCK:
        if _SESSION is not None:
            _SESSION.close()
            _SESSION = None
