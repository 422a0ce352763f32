"""The reader side: a Prometheus collector of the running deployment's stats blocks.

``/metrics`` is served by processes that produce none of the numbers (the front-end, or each
API server), so ``AFDCollector`` reads every block of the deployment in ``VLLM_AFD_RUNTIME`` at
scrape time and turns it into metric families; nothing is pushed or aggregated anywhere else.
``register_collector`` adds it to a registry once; patch P6
(``vllm_afd.patches.metrics_registry``) puts it in the registries vLLM's ``/metrics`` answers
from.

Every series carries vLLM's ``model_name`` label (the served model name) next to its own, and
the attention-side ones vLLM's ``engine`` label too (the engine index of the attention rank:
its data-parallel rank in this front-end; empty for another front-end's ranks of a shared FFN
group), so that they join vLLM's series in a query. The front-end exports both
(``VLLM_AFD_FRONT_END``, ``metric_labels``).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from dataclasses import dataclass

from vllm_afd import envs
from vllm_afd.metrics.blocks import (
    _A_BYTES_RECEIVED,
    _A_BYTES_SENT,
    _A_ERRORS,
    _A_REDISPATCHED,
    _A_SECONDS,
    _F_BYTES_IN,
    _F_BYTES_OUT,
    _F_REQUESTS,
    _F_SECONDS,
    _SCALAR_WORDS,
    A_STEP_SECONDS,
    A_STEPS,
    BUCKETS,
    ERROR_KINDS,
    BlockSnapshot,
    attention_block_name,
    ffn_block_name,
    read_block,
    spec_directory,
    spec_fields,
)
from vllm_afd.transport import directory as ffn_directory


def _histogram_buckets(snapshot: BlockSnapshot | None) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs, as prometheus_client's own histograms label them."""
    from prometheus_client.utils import floatToGoString

    bounds = snapshot.bounds if snapshot else list(BUCKETS)
    counts = snapshot.hist if snapshot else [0.0] * (len(bounds) + 1)
    out, total = [], 0.0
    for bound, count in zip([*bounds, float("inf")], counts, strict=True):
        total += count
        out.append((floatToGoString(bound), total))
    return out


@dataclass(frozen=True)
class MetricLabels:
    """What the AFD series carry of vLLM's labels (in ``VLLM_AFD_FRONT_END``)."""

    model_name: str = ""
    #: This front-end's first attention rank in the group and its count of them.
    first_attention_rank: int = 0
    attention_ranks: int = 0
    tensor_parallel_size: int = 1

    def engine(self, attention_rank: int) -> str:
        """vLLM's ``engine`` label of ``attention_rank`` ("" if another front-end's)."""
        local = attention_rank - self.first_attention_rank
        if not 0 <= local < self.attention_ranks:
            return ""
        return str(local // self.tensor_parallel_size)

    @classmethod
    def current(cls) -> MetricLabels:
        """This process's, from ``VLLM_AFD_FRONT_END`` (none: unlabelled)."""
        try:
            facts = json.loads(envs.VLLM_AFD_FRONT_END or "{}")
            return cls(
                **{f.name: facts[f.name] for f in dataclasses.fields(cls) if f.name in facts}
            )
        except (ValueError, TypeError):
            return cls()


def metric_labels(vllm_config, first_attention_rank: int, attention_ranks: int) -> MetricLabels:
    """The labels of a front-end serving ``vllm_config`` (what ``deployment`` exports)."""
    served = vllm_config.model_config.served_model_name
    name = served[0] if isinstance(served, (list, tuple)) else served
    return MetricLabels(
        str(name or vllm_config.model_config.model),
        first_attention_rank,
        attention_ranks,
        vllm_config.parallel_config.tensor_parallel_size,
    )


#: vLLM's labels in front of each family's own: FFN-side and attention-side series.
_FFN = ["model_name"]
_ATTENTION = ["model_name", "engine"]


@dataclass(frozen=True)
class DeploymentBlocks:
    """The stats blocks of a running deployment, as read now (``None``: not there)."""

    #: Each FFN rank's directory entry (its current address; a replaced rank has a new one).
    entries: list[ffn_directory.RankEntry | None]
    ffn: list[BlockSnapshot | None]
    attention: list[BlockSnapshot | None]


def read_deployment(runtime) -> DeploymentBlocks:
    """Every block of the deployment ``runtime`` (a TransportSpec as object, dict or JSON)."""
    addresses, num_attention, num_ffn = spec_fields(runtime)
    where = spec_directory(runtime)
    entries: list[ffn_directory.RankEntry | None] = (
        ffn_directory.entries(where, num_ffn) if where else [None] * num_ffn
    )
    current = [
        entry.address if entry else (addresses[r] if r < len(addresses) else None)
        for r, entry in enumerate(entries)
    ]
    return DeploymentBlocks(
        entries,
        [read_block(ffn_block_name(a, r)) if a else None for r, a in enumerate(current)],
        [read_block(attention_block_name(addresses, a)) for a in range(num_attention)],
    )


class AFDCollector:
    """Prometheus collector of the running deployment's stats blocks (read at scrape time).

    Args:
        runtime: the deployment's TransportSpec (object, dict or JSON); default: read
            ``VLLM_AFD_RUNTIME`` at each scrape (nothing is reported while it is unset).
    """

    def __init__(self, runtime=None) -> None:
        self._runtime = runtime

    def describe(self):
        return list(self._families().values())

    def collect(self):
        runtime = self._runtime if self._runtime is not None else envs.VLLM_AFD_RUNTIME
        if not runtime:
            return []
        try:
            where = spec_directory(runtime)
            pool = ffn_directory.read_pool(where) if where else None
            if pool is not None:  # a live scale's pool (this API server's variable is older)
                runtime, where = pool.spec, spec_directory(pool.spec)
            blocks = read_deployment(runtime)
        except (ValueError, KeyError, TypeError):
            return []
        families = f = self._families()
        labels = MetricLabels.current()
        model = labels.model_name
        entries, num_ffn = blocks.entries, len(blocks.entries)
        for r, block in enumerate(blocks.ffn):
            series, entry = [model, str(r)], entries[r]
            f["failovers"].add_metric(series, entry.failovers if entry else 0)
            f["recovery"].add_metric(
                series, entry.failovers if entry else 0, entry.recovery_s if entry else 0.0
            )
            f["alive"].add_metric(series, 1.0 if block is not None and block.alive() else 0.0)
            given_up = entry is not None and entry.state == ffn_directory.FAILED
            f["given_up"].add_metric(series, 1.0 if given_up else 0.0)
            scalars = block.scalars if block else [0.0] * _SCALAR_WORDS
            f["ffn_requests"].add_metric(series, scalars[_F_REQUESTS])
            f["ffn_bytes"].add_metric([*series, "in"], scalars[_F_BYTES_IN])
            f["ffn_bytes"].add_metric([*series, "out"], scalars[_F_BYTES_OUT])
            f["ffn_service"].add_metric(series, _histogram_buckets(block), scalars[_F_SECONDS])
            for layer, (calls, seconds, tokens) in sorted((block.layers if block else {}).items()):
                f["ffn_layer_service"].add_metric([*series, str(layer)], calls, seconds)
                f["ffn_tokens"].add_metric([*series, str(layer)], tokens)
        # The live pool (a scale changes it) and the scales so far.
        f["ffn_ranks"].add_metric([model], num_ffn)
        scales = pool.events if pool else ()
        f["scales"].add_metric([model], len(scales), sum(e["took_s"] for e in scales))
        f["scale_stall"].add_metric([model], len(scales), sum(e["stall_s"] for e in scales))
        _add_advice(f, model, ffn_directory.read_advice(where) if where else None)
        for a, block in enumerate(blocks.attention):
            series = [model, labels.engine(a), str(a)]
            scalars = block.scalars if block else [0.0] * _SCALAR_WORDS
            f["steps"].add_metric(series, scalars[A_STEPS], scalars[A_STEP_SECONDS])
            peers = block.peers if block else []
            for r in range(num_ffn):
                f["dispatched"].add_metric([*series, str(r)], peers[r] if r < len(peers) else 0.0)
            f["bytes"].add_metric([*series, "sent"], scalars[_A_BYTES_SENT])
            f["bytes"].add_metric([*series, "received"], scalars[_A_BYTES_RECEIVED])
            for i, kind in enumerate(ERROR_KINDS):
                f["errors"].add_metric([*series, kind], scalars[_A_ERRORS + i])
            f["redispatched"].add_metric(series, scalars[_A_REDISPATCHED])
            f["exposed"].add_metric(series, _histogram_buckets(block), scalars[_A_SECONDS])
            for layer, (calls, seconds, _) in sorted((block.layers if block else {}).items()):
                f["layer_exposed"].add_metric([*series, str(layer)], calls, seconds)
        return list(families.values())

    @staticmethod
    def _families() -> dict:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            SummaryMetricFamily,
        )

        return {
            "ffn_ranks": GaugeMetricFamily(
                "vllm_afd_ffn_ranks",
                "FFN ranks of the pool the attention ranks serve on now (POST /afd/scale "
                "changes it).",
                labels=_FFN,
            ),
            "scales": SummaryMetricFamily(
                "vllm_afd_ffn_pool_scale_seconds",
                "Live scales of the FFN pool, each from the request to the old pool stopped "
                "(count = scales).",
                labels=_FFN,
            ),
            "scale_stall": SummaryMetricFamily(
                "vllm_afd_ffn_pool_scale_stall_seconds",
                "The longest time one attention rank's step waited for its switch to the new "
                "pool, per scale (count = scales).",
                labels=_FFN,
            ),
            "steps": SummaryMetricFamily(
                "vllm_afd_decode_step_seconds",
                "Period of the attention rank's decode steps, each from its start to the next's "
                "(count = decode steps).",
                labels=[*_ATTENTION, "attention_rank"],
            ),
            **_advice_families(),
            "failovers": CounterMetricFamily(
                "vllm_afd_ffn_failovers",
                "Times the FFN rank was lost (died, stopped, wedged) and replaced.",
                labels=[*_FFN, "ffn_rank"],
            ),
            "recovery": SummaryMetricFamily(
                "vllm_afd_ffn_recovery_seconds",
                "Time from detecting the loss of the FFN rank to its replacement serving "
                "(count = failovers).",
                labels=[*_FFN, "ffn_rank"],
            ),
            "redispatched": CounterMetricFamily(
                "vllm_afd_redispatched_requests",
                "Requests (one per layer, microbatch and FFN rank) the attention rank sent again "
                "to a replaced FFN rank: the layers a failover interrupted.",
                labels=[*_ATTENTION, "attention_rank"],
            ),
            "alive": GaugeMetricFamily(
                "vllm_afd_ffn_rank_alive",
                "1 if the FFN rank's process is running, else 0 (same-host check).",
                labels=[*_FFN, "ffn_rank"],
            ),
            "given_up": GaugeMetricFamily(
                "vllm_afd_ffn_rank_given_up",
                "1 once failover gave up on the FFN rank (it failed too often in a row): its "
                "requests fail until the server is restarted; else 0.",
                labels=[*_FFN, "ffn_rank"],
            ),
            "ffn_service": HistogramMetricFamily(
                "vllm_afd_ffn_service_seconds",
                "FFN service time of one layer batch (experts of all attention ranks' "
                "requests for that layer, replies included).",
                labels=[*_FFN, "ffn_rank"],
            ),
            "ffn_layer_service": SummaryMetricFamily(
                "vllm_afd_ffn_layer_service_seconds",
                "FFN service time per MoE layer (count = layer batches served).",
                labels=[*_FFN, "ffn_rank", "layer"],
            ),
            "ffn_tokens": CounterMetricFamily(
                "vllm_afd_ffn_tokens",
                "Token rows the FFN rank computed, per MoE layer.",
                labels=[*_FFN, "ffn_rank", "layer"],
            ),
            "ffn_requests": CounterMetricFamily(
                "vllm_afd_ffn_requests",
                "Requests (one per attention rank, layer and dispatch) the FFN rank answered.",
                labels=[*_FFN, "ffn_rank"],
            ),
            "ffn_bytes": CounterMetricFamily(
                "vllm_afd_ffn_bytes",
                "Payload bytes the FFN rank received (hidden states, expert ids and weights) "
                "and sent back (outputs).",
                labels=[*_FFN, "ffn_rank", "direction"],
            ),
            "dispatched": CounterMetricFamily(
                "vllm_afd_dispatched_tokens",
                "Token rows the attention rank dispatched to each FFN rank.",
                labels=[*_ATTENTION, "attention_rank", "ffn_rank"],
            ),
            "bytes": CounterMetricFamily(
                "vllm_afd_transport_bytes",
                "Payload bytes the attention rank sent to and received from the FFN ranks.",
                labels=[*_ATTENTION, "attention_rank", "direction"],
            ),
            "errors": CounterMetricFamily(
                "vllm_afd_transport_errors",
                "Failed combines on the attention rank, by kind "
                "(timeout, ffn_dead, ffn_error, other).",
                labels=[*_ATTENTION, "attention_rank", "kind"],
            ),
            "exposed": HistogramMetricFamily(
                "vllm_afd_exposed_ffn_seconds",
                "Time the attention rank waited in combine per round trip (FFN time not "
                "hidden by overlap).",
                labels=[*_ATTENTION, "attention_rank"],
            ),
            "layer_exposed": SummaryMetricFamily(
                "vllm_afd_layer_exposed_ffn_seconds",
                "Exposed FFN time per MoE layer (count = round trips).",
                labels=[*_ATTENTION, "attention_rank", "layer"],
            ),
        }


#: The advisor's window (``placement.autoscale.Window`` field -> metric name, help).
_WINDOW_GAUGES = {
    "step_ms": ("vllm_afd_window_step_seconds", "Mean period of one decode step"),
    "batch": ("vllm_afd_window_batch_requests", "Requests per decode step and attention rank"),
    "context": ("vllm_afd_window_context_tokens", "Context tokens per request"),
    "attention_ms": (
        "vllm_afd_window_attention_layer_seconds",
        "Attention time per layer (the step less its exposed FFN time)",
    ),
    "ffn_ms": ("vllm_afd_window_ffn_layer_seconds", "FFN service time per layer batch"),
}


def _advice_families() -> dict:
    from prometheus_client.core import GaugeMetricFamily

    window = " in the planner in the loop's last window of measurement (--afd-autoscale)."
    return {
        "recommended": GaugeMetricFamily(
            "vllm_afd_planner_recommended_ffn_ranks",
            "FFN ranks the planner recommends for the measured batch and context.",
            labels=_FFN,
        ),
        "predicted": GaugeMetricFamily(
            "vllm_afd_planner_predicted_step_seconds",
            "The planner's decode step time at the measured batch and context, per FFN rank "
            "count (next to vllm_afd_window_step_seconds, measured).",
            labels=[*_FFN, "num_ffn_ranks"],
        ),
        "predicted_tokens": GaugeMetricFamily(
            "vllm_afd_planner_predicted_tokens_per_device",
            "The planner's tokens/s per device (attention and FFN) per FFN rank count.",
            labels=[*_FFN, "num_ffn_ranks"],
        ),
        "disturbed": GaugeMetricFamily(
            "vllm_afd_window_disturbed",
            "1 when the last window held a scale or a failover (no measure of the steady load, "
            "not decided on).",
            labels=_FFN,
        ),
        "rule": GaugeMetricFamily(
            "vllm_afd_autoscale_rule",
            "1 for the rule that made the last autoscale decision (scale, or why it held).",
            labels=[*_FFN, "rule"],
        ),
        **{
            key: GaugeMetricFamily(name, text + window, labels=_FFN)
            for key, (name, text) in _WINDOW_GAUGES.items()
        },
    }


def _add_advice(f: dict, model: str, advice: dict | None) -> None:
    """The advisor's latest advice (``directory.read_advice``) into its gauges."""
    if not advice:
        return
    try:
        f["rule"].add_metric([model, str(advice["rule"])], 1.0)
        if advice.get("recommended"):
            f["recommended"].add_metric([model], advice["recommended"]["num_ffn_ranks"])
        for c in advice.get("candidates") or ():
            series = [model, str(c["num_ffn_ranks"])]
            f["predicted"].add_metric(series, c["step_ms"] / 1e3)
            f["predicted_tokens"].add_metric(series, c["tokens_per_device"])
        window = advice.get("window") or {}
        if window:
            f["disturbed"].add_metric([model], 1.0 if window.get("disturbed") else 0.0)
        for key in _WINDOW_GAUGES:
            if key in window:
                scale = 1e-3 if key.endswith("_ms") else 1.0
                f[key].add_metric([model], window[key] * scale)
    except (KeyError, TypeError):
        return  # a malformed file is reported as far as it goes


# Registries that already have a collector (a registry's collect would report it twice).
_REGISTERED: weakref.WeakSet = weakref.WeakSet()


def register_collector(registry=None) -> AFDCollector | None:
    """Add an ``AFDCollector`` to ``registry`` (default: prometheus_client's global REGISTRY),
    once per registry. Returns it, or ``None`` if the registry already has one."""
    if registry is None:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    if registry in _REGISTERED:
        return None
    collector = AFDCollector()
    registry.register(collector)
    _REGISTERED.add(registry)
    return collector
