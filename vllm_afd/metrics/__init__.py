"""AFD metrics on vLLM's ``/metrics``: shared-memory counters + a Prometheus collector.

The numbers are produced in processes that do not serve ``/metrics``: FFN ranks (Ray actors)
and attention ranks (vLLM worker processes); ``/metrics`` is served by the front-end or, with
several API servers, by each API-server process. So every producer owns one small *stats
block*, a file in ``/dev/shm`` of 8-byte words, and ``AFDCollector`` reads all blocks of the
running deployment at scrape time. Nothing is sent anywhere and nothing is locked: a writer
updates its own words with plain stores, no syscall (numbers: docs/benchmarks.md); a reader
copies the whole block with one ``read``. A scrape may see a histogram bucket incremented
before its sum (words are written one after another), never a torn word.

Finding the blocks. Every process of a deployment inherits ``VLLM_AFD_RUNTIME`` (the running
FFN group's ``TransportSpec`` as JSON, see ``envs.py``), whose ``addresses`` name the FFN
ranks' transport endpoints. Names are derived from it::

    FFN rank f:        vllm_afd_metrics_<sha1(addresses[f])[:16]>_f<f>
    attention rank a:  vllm_afd_metrics_<sha1("\\n".join(addresses))[:16]>_a<a>

The FFN rank names its block after its own transport address (it cannot know the others' when
it starts); the deployment id of the attention blocks covers all of them.

Lifetime. The writer creates its block (``O_EXCL``), writes the header, magic last, and unlinks
it on ``close()``, at interpreter exit and when collected. A writer killed by a signal leaks its
block until someone unlinks it: the front-end (``unlink_deployment_blocks`` when the FFN group
stops) or any new writer (``reap_stale_blocks``: blocks whose writer, in this pid namespace, is
gone). A dead FFN rank's block is kept until then, so ``vllm_afd_ffn_rank_alive`` reads 0 and its
last counters stay visible.

Other users. The names are derived, so another user of the host can guess them and plant a
file first (or a link). Blocks are created with ``O_EXCL``/``O_NOFOLLOW``, mode 0600; a writer
that finds its name taken by a stale block of its own reaps it and retries, and otherwise runs
without metrics (logged; metrics never keep a rank from serving). Readers open with
``O_NOFOLLOW``/``O_NONBLOCK`` and read only this user's own regular 0600 files whose size is
exactly what their header's layout needs (``read_block``): a planted block is never read, so it
can neither spoof counters nor make a scrape read a large (sparse) file.

Liveness (``vllm_afd_ffn_rank_alive``): 1 when the FFN rank's block exists, is open and its writer
process exists with the start time it recorded (no pid reuse); 0 otherwise. Blocks of another
pid namespace are trusted on their state word alone. Blocks live in this host's ``/dev/shm``:
FFN ranks on another host are reported as not alive (see docs/metrics.md).

Modules, writers to reader (import from them; this package re-exports nothing):

- ``blocks.py``: the block format and names, the writers (``FFNStatsBlock``, owned by
  ``ffn.executor.FFNStats``; ``AttentionStatsBlock``), the reader and the clean-up.
- ``recorder.py``: the attention process's block (``endpoint_block``, which the hook records
  each combine into, and ``record_error``; one block per process).
- ``collector.py``: ``AFDCollector``, which vLLM's ``/metrics`` registries get through
  ``register_collector`` and patch P6 (``vllm_afd.patches.metrics_registry``).
"""
