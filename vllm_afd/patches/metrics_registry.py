"""Front-end (API servers), P6: the AFD collector in every registry that answers ``/metrics``
(ledger in ``__init__``).

With one API server that registry is prometheus_client's global ``REGISTRY`` (vLLM's
``get_prometheus_registry`` returns it); the collector is registered there through the public
API. With several (``PROMETHEUS_MULTIPROC_DIR`` set) there is no long-lived registry to add to:
vLLM's ``get_prometheus_registry`` builds a fresh ``CollectorRegistry`` + ``MultiProcessCollector``
per API server, and prometheus-fastapi-instrumentator's ``/metrics`` handler (the route that
answers, installed by vLLM's ``instrumentator.metrics.attach_router``) builds another one on
every scrape. Both are built with ``MultiProcessCollector(registry)``, the one hook they share,
so its ``__init__`` is wrapped. The collector reports nothing while ``VLLM_AFD_RUNTIME`` is
unset, so non-AFD servers and processes that never serve ``/metrics`` are unaffected.
"""

from __future__ import annotations

import logging

from vllm_afd.patches.base import wrap

logger = logging.getLogger("vllm.afd")


def _multiprocess_collector_init(original):
    from vllm_afd.metrics.collector import register_collector

    def __init__(self, registry, *args, **kwargs):
        original(self, registry, *args, **kwargs)
        if registry is not None:
            try:
                register_collector(registry)
            except Exception as exc:  # noqa: BLE001 - never break vLLM's own /metrics
                logger.warning("AFD metrics collector not registered: %s", exc)

    return __init__


def patch_metrics_registries() -> None:
    """P6: an ``AFDCollector`` in ``REGISTRY`` and in every registry a
    ``MultiProcessCollector`` joins (idempotent)."""
    from vllm_afd.metrics.collector import register_collector

    register_collector()
    wrap("P6", _multiprocess_collector_init)


apply = patch_metrics_registries
