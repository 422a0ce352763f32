"""Every touch of a vLLM (or Ray) internal, grouped by the process it runs in, with its ledger.

vLLM loads general plugins in every process it starts (API server, engine core, each worker),
so ``apply()`` applies every group in every process. A group that does not belong to a process
is inert there: it wraps a class that process never calls.

- front-end (the process that parses flags and builds the ``VllmConfig``):
  ``engine_args.py`` (P1-P3, and M6, which the engine core's re-validation runs too),
  ``health.py`` (P4), ``metrics_registry.py`` (P6); ``ray_errors.py`` (R1, Ray's driver: applied
  by failover's supervisor, not by ``apply()``).
- worker (the processes that run the model): ``layers.py`` (P5, P7, P8), ``cpu_runner.py``
  (M1-M7), ``gpu_runner.py`` (G1-G2, GPUs only), ``cpu_comm.py`` (S1-S2), ``cpu_amx.py``
  (S3, every process), ``dp_store.py`` (S4), ``request_errors.py`` (W1, W3).
- engine core (the process that runs vLLM's scheduler): ``request_errors.py`` (W2).
- every process: ``environ.py`` (E1).
- FFN rank (the FFN ranks' processes): ``ffn_rank.py`` (F1-F4). Not applied by ``apply()``:
  ``ffn/weights.py`` enters its context manager around building one rank's MoE layers, and
  every swap is undone when the build is done. It also applies ``cpu_comm.py`` there (S2:
  vLLM's CPU kernel honours the ``expert_map`` an FFN rank's layers have) and ``cpu_amx.py``
  (S3).

Mechanism (``base.py``, a leaf module so the groups need not import this package). Every
wrapper goes through ``_wrap`` (one sentinel, ``__vllm_afd_patched__``, so it installs once),
and every touch point is a row of ``base.TARGETS`` with the parameters its patch relies on.
``_wrap`` and ``check`` refuse a target that is missing or lacks a parameter with an
``ImportError`` naming the patch; tests/unit/patches/test_compat.py checks the same table
against the installed vLLM.

Version policy (``base.SUPPORTED_VLLM = ("0.32.", "0.33.")``). On any other version ``apply()``
warns once and still applies every patch: each one checks its target's shape first, so a
layout that changed fails loudly (ImportError), and one that did not keeps working.

Ledger
------
Front-end

P1 ``EngineArgs.add_cli_args`` (staticmethod), wrapped.
   Why: vLLM has no hook for plugins to add ``vllm serve`` flags; ``--afd-ratio`` must exist.
   How: after the stock parser is built, add the "AFD" argument group
   (``config.add_afd_flags``).
   Upstream: none; vLLM's answer for plugins is ``--additional-config``, which works without
   this patch (``--additional-config.afd.ratio 7:1``). Native flags would come with AFD
   upstream (RFC vllm-project/vllm#22799).
   Remove when: vLLM offers a plugin CLI-argument hook, or the flags move to the long form.
P2 ``EngineArgs.from_cli_args`` (classmethod), wrapped.
   Why: it builds EngineArgs only from dataclass fields and would drop the AFD flags.
   How: merge the parsed AFD flags into ``additional_config["afd"]``
   (``config.merge_afd_flags``; giving one key both as a flag and in the long form is an error).
   Upstream: as P1.
   Remove when: as P1.
P3 ``EngineArgs.create_engine_config``, wrapped.
   Why: the FFN group must be validated and started in the front-end before any engine or
   worker process exists, and its address handed to them.
   How: before: ``deployment.prepare_engine_args`` (``--afd-transport auto`` resolved for the
   devices; on GPUs DBO, CUDA graphs without piecewise graphs and the V2 model runner, so that
   vLLM validates the config AFD runs; a server given only ``--afd-ratio A:F`` gets A
   data-parallel attention ranks); after the stock config is built,
   ``deployment.setup_afd(vllm_config)``.
   Upstream: none for a generic hook; AFD inside vLLM (RFC vllm-project/vllm#22799) would own
   this lifecycle.
   Remove when: vLLM grows a "deployment plugin" lifecycle hook.
P4 ``AsyncLLM.check_health``, wrapped.
   Why: ``/health`` (liveness) must report unhealthy as soon as an FFN rank is lost and
   failover cannot heal it, even while idle.
   How: raise ``EngineDeadError`` for the FFN group's problems that are not ``healing``
   (``placement/health.py``); readiness, every problem, is ``/afd/ready`` (a supported
   endpoint plugin, ``placement/routes.py``).
   Upstream: none filed; vLLM has no way for plugins to contribute health checks.
   Remove when: vLLM lets plugins contribute health checks.
P6 ``prometheus_client.multiprocess.MultiProcessCollector.__init__``, wrapped (a library
   vLLM serves ``/metrics`` through), plus an ``AFDCollector`` in the global ``REGISTRY``.
   Why: the AFD metrics are read from shared memory at scrape time by a custom collector,
   which must be in the registry that answers ``/metrics``. With several API servers that
   registry is rebuilt per scrape, and ``MultiProcessCollector(registry)`` is the one hook
   all of them share.
   How: every registry it joins also gets an ``AFDCollector`` (once); the global registry
   gets one too. Reports nothing when AFD is off.
   Upstream: none; ``vllm.stat_logger_plugins`` receive engine-core stats, not a collector
   read at scrape time.
   Remove when: vLLM lets plugins contribute collectors to its ``/metrics`` registry.
R1 ``ray._private.worker.print_to_stdstream`` (module function; Ray 2.60), wrapped once Ray
   is up (``placement.cluster.ensure_ray``).
   Why: when the supervisor kills a lost FFN rank, or the rank dies, the raylet reports the
   worker's death to the driver, which prints it with "killed by the OOM killer" among its
   guesses: on every failover, whatever the cause. The plugin logs the loss and the
   replacement itself.
   How: a raylet report naming the ``Worker PID`` of an FFN rank a supervisor watches or
   watched (``failover.supervised_pid``) is not printed; every other one is, unchanged.
   Upstream: none; Ray prints every error message a job's driver receives.
   Remove when: Ray lets a driver filter the error messages it prints, or tells a worker
   killed by ``ray.kill`` from one that crashed.

Worker

P5 ``RoutedExperts`` out-of-tree replacement (``PluggableLayer.register_oot``).
   Why: the routing boundary (``quant_method.apply`` after ``select_experts``) is where the
   tokens leave for the FFN group.
   How: ``RoutedExperts.register_oot(AFDRoutedExperts)``; vLLM then builds the subclass, which
   behaves exactly like the stock class when AFD is off.
   Upstream: none needed: a supported API, listed so every touch point is here.
   Remove when: never (the supported way to swap a layer).
P7 ``RoutedExperts._get_quant_method``, overridden (private) by ``AFDRoutedExperts`` in
   ``vllm_afd/attention/layer.py``.
   Why: the quant method is what ``forward_modular`` calls at the routing boundary; AFD needs
   one that ships the tokens instead of running local experts, and vLLM picks it only here.
   How: with AFD on, return ``AFDRemoteExpertsMethod``; otherwise the stock method.
   Upstream: none filed; it needs a public way for an out-of-tree ``RoutedExperts`` to supply
   its ``FusedMoEMethodBase``.
   Remove when: vLLM exposes that choice publicly (or AFD becomes an all2all backend).
P8 ``vllm.compilation.backends.model_tag`` (module global), read by ``AFDRoutedExperts``.
   Why: a speculative-decoding draft's MoE layers (MTP, an MoE EAGLE head or draft model) must
   not become AFD layers: the FFN ranks serve the target's experts by the target's layer
   numbers, which the draft's may repeat (a silent use of the wrong experts, visible only in
   the acceptance rate). vLLM builds every draft under ``set_model_tag(<not "backbone">)``.
   How: while the tag is not ``"backbone"`` the stock quant method is returned: the draft's
   experts load and run on the attention ranks as in stock vLLM.
   Upstream: none filed; a public "building the draft" flag would do.
   Remove when: vLLM marks draft models publicly, or the FFN ranks serve drafts too.
M1 ``CPUModelRunner.__init__``, wrapped.
   Why: vLLM builds per-microbatch attention metadata (one metadata builder per microbatch)
   only when ``ParallelConfig.use_ubatching``; but the CPU platform turns ``--enable-dbo`` off
   and ``VllmConfig`` rejects ``--ubatch-size`` without a DeepEP/NIXL all2all backend, so
   neither can be asked for on the command line.
   How: on an AFD attention rank with ``microbatches = k > 1``, after the stock init (and
   before the KV cache and its metadata builders exist) set this process's
   ``parallel_config.ubatch_size = k``, ``dbo_decode_token_threshold = k`` and
   ``dbo_prefill_token_threshold`` above ``max_num_batched_tokens`` (decode steps only).
   Unsupported combinations are refused (``config.check_supported``). The platform check in
   platforms/cpu.py is left alone: it only touches ``enable_dbo``.
   Upstream: none for CPU; DBO (vllm-project/vllm#23693) is CUDA-only.
   Remove when: vLLM supports microbatching on CPU and lets an out-of-tree MoE kernel opt in.
M2 ``_determine_batch_execution_and_padding``, overridden on ``CPUModelRunner``.
   Why: stock vLLM sets ``should_ubatch`` only in its data-parallel branch
   (``coordinate_batch_across_dp``); one attention rank never microbatches.
   How: with data_parallel_size 1, ``should_ubatch`` = ``allow_microbatching`` (vLLM's
   prefix-cache veto) and ``check_ubatch_thresholds``. With DP > 1 the stock decision stands.
   Upstream: RFC vllm-project/vllm#56126 (DBO at DP = 1; closed, not merged).
   Remove when: vLLM microbatches without data parallelism.
M3 ``_dummy_run``, overridden on ``CPUModelRunner``.
   Why: dummy runs call ``self.model`` directly; on CPU it is not wrapped (no
   ``UBatchWrapper``), so a microbatched dummy run would hand per-microbatch lists to layers.
   How: ``allow_microbatching=False`` (with DP > 1 this vetoes the step on every rank).
   Upstream: as M4.
   Remove when: M4 is upstream.
M4 ``_model_forward``, overridden on ``CPUModelRunner`` (vLLM documents it as the method to
   override for model execution).
   Why: the GPU runner wraps the model in ``UBatchWrapper`` (CUDA streams and events); the
   CPU runner runs microbatched steps nowhere.
   How: when the forward context carries ``ubatch_slices``, run the stock ``_model_forward``
   on each token slice on a ``PingPong`` thread with its own ``ForwardContext``, concatenate.
   Upstream: none for CPU; vllm-project/vllm#50738 (DBO for model runner V2) is GPU-only.
   Remove when: vLLM ships a CPU ubatch wrapper.
M5 ``vllm.forward_context._forward_context`` (private module global), written.
   Why: the forward context is one global, not per thread; each microbatch thread must see
   its own whenever it gets the baton, and ``override_forward_context`` restores on exit, so
   it cannot follow hand-offs.
   How: ``PingPong``'s resume hook assigns the microbatch's context to the global (what
   vLLM's own ``UBatchContext`` does in v1/worker/ubatching.py).
   Upstream: none; a thread-local or settable forward context would remove it.
   Remove when: M4 is upstream, or vLLM offers a public setter.
M6 ``VllmConfig.__post_init__``, wrapped (``engine_args.py``; front-end and engine core, every
   platform).
   Why: vLLM asserts that microbatching runs over a DeepEP or NIXL all-to-all backend
   (``config/vllm.py``, "Microbatching currently only supports ..."). AFD microbatches
   (``--afd-microbatches 2``: on GPUs vLLM's DBO, set before vLLM validates the config,
   ``deployment._fit_gpu_engine_args``; on the CPU build ``ubatch_size``, set by M1 in the
   worker) and runs no all-to-all on its attention ranks, so the front-end's validation failed
   on GPUs, and every server's engine core, which re-validates its config after the handshake
   (``v1/engine/core.py``, ``_perform_handshakes``), failed on both.
   How: while an AFD config (``additional_config["afd"]``) with ``use_ubatching`` is
   validated, ``all2all_backend`` reads ``deepep_low_latency`` (the backend whose receive-hook
   protocol the AFD op follows under DBO; nothing else in the validation reads it but for
   DeepEP high-throughput and MoonEP), and the user's value is put back after.
   Upstream: none; the check would have to ask the MoE layers whether they use an all-to-all.
   Remove when: vLLM lets an out-of-tree MoE method that owns its dispatch and combine opt in
   to microbatching (its "passthrough" all-to-all backend, once DBO accepts it).
M7 ``SharedExperts.__init__`` wrapped, and its ``_output_idx`` property's getter
   (fused_moe/runner/shared_experts.py).
   Why: a layer's shared experts keep their output in a slot chosen by vLLM's DBO microbatch
   id (0 without DBO) between computing it and adding it to the routed experts' output; two
   AFD microbatches interleave at the routing boundary, so the second one found the first one's
   output in slot 0 (an assertion: every model with shared experts, e.g. Qwen2-MoE and
   DeepSeek, failed at its first microbatched decode step).
   How: ``_output_idx`` returns the AFD microbatch running on this thread
   (``microbatch.current_microbatch``), vLLM's own choice outside a microbatched step; the
   slot list gets one slot per possible microbatch (``config.MAX_MICROBATCHES``).
   Upstream: none; the slot is tied to DBO's thread registry, which M4's threads are not in.
   Remove when: M4 is upstream (vLLM's CPU ubatch wrapper registers its threads as DBO's do).
G1 ``ModelCudaGraphManager.run_fullgraph`` (the V2 model runner's FULL CUDA-graph replay),
   wrapped; GPUs only. NOT YET RUN ON A GPU.
   Why: the AFD op announces each step to the FFN ranks from Python inside the forward
   (``attention/steps.py``); a replayed graph runs its dispatch/combine kernels without
   that Python, so the FFN ranks would never learn the step the kernels' flags belong to.
   How: before the replay, announce a step of ``desc.num_ubatches`` microbatches, each with
   its tokens as vLLM's own ``maybe_create_ubatch_slices`` splits ``desc.num_tokens``
   (``AttentionSession.begin_step``); nothing without an FFN group in the process.
   Upstream: none; the peer plugin sends its control message from its own model runner.
   Remove when: AFD is upstream (RFC vllm-project/vllm#22799), or vLLM has a pre-forward
   hook that runs for graph replays too.
G2 ``vllm.v1.worker.ubatching``: ``dbo_enabled``, ``dbo_current_ubatch_id``, ``dbo_yield``,
   ``dbo_maybe_run_recv_hook``, ``dbo_register_recv_hook`` (public) and ``_CURRENT_CONTEXTS``,
   ``_NUM_UBATCHES`` (private module globals), read and called.
   GPUs only. NOT YET RUN ON A GPU (the yield order is tested on CPU with vLLM's own ubatch
   threads: tests/unit/test_gpu_microbatching.py).
   Why: under vLLM's DBO (``--afd-microbatches 2`` on GPUs) the AFD op's microbatch is the
   ubatch id, and it overlaps as vLLM's own MoE kernels do: two yields per MoE layer and a
   receive hook; the first ubatch's first MoE layer announces the step with every ubatch's
   forward context, which only the ubatch contexts hold.
   How: read and called as they are (``microbatch.vllm_dbo`` and its callers,
   ``attention.steps.dbo_ubatches``, ``attention.exchange.dbo_exchange``).
   Upstream: none; a public "ubatches of this step" accessor would do.
   Remove when: AFD is upstream.
S1 ``CpuCommunicator.all_gatherv`` and ``CpuCommunicator.reduce_scatterv``, added.
   Why: vLLM's CPU build inherits both from ``DeviceCommunicatorBase``, where they raise
   ``NotImplementedError``. Colocated data parallelism on CPU (``--data-parallel-size 2``, with
   or without ``--enable-expert-parallel``) calls them from the MoE layer on its first request,
   so the wide-EP baseline the A/B harness compares AFD against could not run on CPU at all.
   How: ``all_gatherv`` pads every rank's rows to the largest size around the communicator's
   equal-size ``all_gather``; ``reduce_scatterv`` is ``all_reduce`` plus this rank's slice
   (details in ``cpu_comm.py``). Only while ``CpuCommunicator`` still inherits the base
   class's methods (a vLLM that implements them wins; nothing is patched).
   Upstream: vllm-project/vllm#57837 (CPU wide expert parallelism; open).
   Remove when: vLLM's ``CpuCommunicator`` implements ``all_gatherv`` and ``reduce_scatterv``.
S2 ``CPUUnquantizedExperts.__init__`` and ``CPUExpertsFp8.__init__`` (experts/cpu_moe.py),
   wrapped.
   Why: with expert parallelism vLLM passes global routing ids plus an ``expert_map``; the
   CPU kernels ignore the map and index their local weights with global ids, which reads out
   of bounds (a segfault in ``cpu_fused_moe``; the FP8 kernel's token-count check fails).
   How: an expert-parallel layer's experts (``moe_parallel_config.use_ep``) get an ``apply``
   that maps the ids to local ids, zeroes the weights of experts held elsewhere, then calls
   vLLM's ``apply`` without the map (details in ``cpu_comm.py``); every other layer keeps
   vLLM's ``apply`` untouched, so the plugin adds no call to the stock path.
   Upstream: vllm-project/vllm#57837 (same CPU wide-EP work).
   Remove when: vLLM's CPU unquantized and FP8 experts honour ``expert_map``.
S3 ``torch.cpu._is_amx_tile_supported`` and ``torch._C._cpu._init_amx`` (PyTorch), called.
   Why: Linux gives a process the AMX tile registers only after ``arch_prctl(
   ARCH_REQ_XCOMP_PERM)``; vLLM's CPU build runs AMX kernels (bfloat16 attention, MoE, MLA)
   whenever the CPU reports AMX and never asks, so where nothing else in the process asked
   first (oneDNN does for its own matmuls) the first one is an illegal instruction: every
   bfloat16 model died with SIGILL on the development machine, colocated too.
   How: ``cpu_amx.apply()`` asks once per process (PyTorch's ``_init_amx``) on CPUs that report
   AMX tiles; nothing else changes (vLLM picks the same kernels). Also run by FFN ranks.
   Upstream: none filed; vLLM's CPU worker (or its ``_C`` extension at load) should ask.
   Remove when: vLLM requests the AMX permission itself.
S4 ``vllm.distributed.parallel_state.create_tcp_store`` (module global), wrapped.
   Why: with data parallelism on one node (every ``--afd-ratio A:F`` server with A > 1), global
   rank 0 creates the world group's ``TCPStore`` as master with port 0, and a ``TCPStore``
   master binds every interface whatever host it is given: worker DP0 listened on ``::``,
   unauthenticated, though every peer connects to ``127.0.0.1`` (the shared server's listener
   scan, tests/e2e/test_server.py).
   How: a master store for a loopback host gets a listening socket bound to that host
   (``dp_store.loopback_listener``), through the ``listen_socket`` parameter vLLM's
   ``create_tcp_store`` already has; other hosts (multi-node) are passed through.
   Upstream: none filed; ``init_distributed_environment`` could pass such a socket itself.
   Remove when: vLLM binds its master stores to the host it is given.

W1 ``GPUModelRunner.execute_model`` and ``GPUModelRunner.sample_tokens`` of both of vLLM's
   model runners (V1's, which the CPU runner inherits; V2's, ``v1/worker/gpu/model_runner.py``,
   the default on CUDA: not yet run on a GPU), wrapped.
   Why: a request an FFN rank fails even alone must fail by itself, not kill the engine
   core (an exception in a forward is fatal to it). The attention-side hook needs the batch's
   request ids and rows to find it (``attention/failures.py``), and the scheduler must learn
   which requests failed.
   How: the step runs as the worker session's step (``AttentionSession.step``): the runner
   becomes the session's (it reads V1's ``input_batch.req_ids`` and ``query_start_loc`` when
   a batch fails; V2 has neither, so there a failed batch is not split by request), so do the
   step's requests (its ``SchedulerOutput``'s: with the device's waits a failure is seen
   after the forward, and the steps it spoiled fail their requests; a V2 dummy run, an
   ``execute_model`` with ``dummy_run``, serves none) and the step lock is held (W3 says
   why); the step's
   ``ModelRunnerOutput`` (or an async one's ``get_output``, after vLLM's wait for the sampled
   tokens: there the device's waits of the step are read, ``AttentionSession.sampled``) gets an
   ``afd_failed_requests`` attribute, request id -> the FFN's error text, when the step failed
   any (on a copy of vLLM's shared empty output). A decode step's
   period (its start to the next decode step's start) is recorded, with its requests and
   context tokens read from the ``SchedulerOutput``, into the rank's stats block
   (``AttentionSession.periods``): the measured load of the planner in the loop.
   Upstream: none; vLLM has no per-request error a model's layer can raise.
   Remove when: vLLM lets a forward fail some of its requests.
W2 ``Scheduler.update_from_output``, wrapped; ``KVCacheManager.get_block_ids`` and
   ``evict_blocks`` called; the scheduler's ``grammar_compile_error_reqs`` set written.
   Why: as W1; vLLM finishes a request with ``FINISHED_ERROR`` (the client gets an error,
   the engine serves on) only for its own causes (grammar compile errors, encoder-cache
   misses, KV-load failures).
   How: before the update, each failed request's token of the step is dropped, its blocks
   leave the prefix cache (their KV was computed without routed experts), and it joins
   ``grammar_compile_error_reqs``, the set the update finishes with ``FINISHED_ERROR``.
   Upstream: none filed; a public "fail these requests" call on the scheduler would do.
   Remove when: as W1.
W3 ``GPUModelRunner._dummy_run`` of both model runners (V1's: the CPU runner inherits it;
   V2's), wrapped.
   Why: a live scale (``POST /afd/scale``) switches each attention rank to the new FFN pool
   at a step boundary; an idle rank has none, so a thread of the worker switches it while no
   step runs. A forward is either a step (W1) or a dummy run (a DP rank's idle forward,
   profiling): both hold the step lock, so the thread never switches in the middle of one.
   How: the call runs holding the session's step lock (``AttentionSession.step``; reentrant).
   Upstream: none; vLLM's elastic EP reconfigures between steps from the engine core
   (``/scale_elastic_ep``), which knows nothing of an FFN pool.
   Remove when: vLLM has a between-steps hook for workers.
W4 ``Worker.load_model`` (v1/worker/gpu_worker.py; the CPU worker inherits it), wrapped.
   Why: an attention worker connects to the FFN group once, before any layer runs, and owns
   that connection in one object (``attention/session.py``); vLLM has no worker-start hook for
   a plugin, and a connection made as a side effect of building a layer (a quant method's
   constructor) ran wherever a layer was built, tests and drafts included.
   How: on an AFD worker (``AFDConfig.of(self.vllm_config)``) ``open_session()`` runs before
   the stock call: the transport endpoint from ``VLLM_AFD_RUNTIME``, this rank's place from
   vLLM's DP and TP groups (initialized in ``init_device``, before ``load_model``).
   Upstream: none; a worker-start hook for general plugins would do.
   Remove when: vLLM offers plugins a hook at worker start.

Every process

E1 ``vllm.envs.environment_variables`` (module global dict), extended.
   Why: vLLM warns about every ``VLLM_*`` variable missing from it ("Unknown vLLM environment
   variable detected") and, with ``--fail-on-environ-validation``, refuses to start
   (``Platform.validate_environ``): a server given ``VLLM_AFD_FFN_CPUS`` could not start so.
   How: each ``vllm_afd.envs`` name is added (if absent) with a reader of its raw text; vLLM
   reads every entry when it caches the table, so the typed, validating reader stays ours.
   Upstream: none needed: the table is where vLLM declares variables; a plugin API to declare
   them would be the supported way.
   Remove when: vLLM offers plugins a way to declare their environment variables.

FFN rank

F1 ``vllm.model_executor.layers.fused_moe.layer.make_parallel_config`` (module global),
   swapped while an FFN rank builds its layers.
   Why: vLLM places experts (``expert_map``) from the EP group of the process's parallel
   state; the F FFN ranks are one process each, with no group between them (they never
   communicate: the attention side sums their answers), so the layers would hold every expert.
   How: the stock config with ``tp_size 1, ep_size F, ep_rank r, use_ep True``
   (``ffn_rank.expert_parallel_placement``); only for ``F > 1``, restored on exit.
   Upstream: none; a way to build a model for a given EP rank without an EP group would
   remove F1-F3 (vLLM's AFD RFC vllm-project/vllm#22799 would own FFN-side placement).
   Remove when: as above.
F2 ``ExpertMapManager.__init__``, swapped for the same block.
   Why: the model is built on the ``meta`` device so that an FFN rank allocates only its
   routed experts; the expert map is data (its constructor logs through ``nonzero()``), which
   fails on ``meta``.
   How: run the stock constructor under the rank's real device (``torch.device``).
   Upstream: none filed (stock vLLM never builds a layer with EP on ``meta``).
   Remove when: as F1.
F3 ``vllm.distributed.parallel_state._EP`` (private module global), swapped for the same block,
   plus ``enable_expert_parallel`` on the FFN rank's own engine config.
   Why: some models' loaders ask the EP group which experts are theirs (gpt-oss slices its
   fused expert tensors by ``get_ep_group()``'s rank, Llama-4 and others read its size).
   How: a stand-in with the rank and size only (``world_size``, ``rank_in_group``,
   ``device_group.size()/rank()``), never used to communicate.
   Upstream: as F1.
   Remove when: as F1.
F4 vLLM functions an FFN rank calls as they are (``ffn/weights.py``, ``ffn/executor.py``):
   ``initialize_model``, ``ep_weight_filter.should_skip_weight``, ``extract_layer_index``,
   ``ExpertMapManager.get_local_expert_ids``,
   ``FusedMoEMethodBase.apply`` and ``process_weights_after_loading``,
   ``init_distributed_environment``, ``initialize_model_parallel``.
   Why: an FFN rank builds the model's own layers and loads them through the model's own
   ``load_weights``, then computes with the layer's quant method, the path stock vLLM takes;
   these are internal APIs without a stability promise.
   How: used unchanged; ``ffn/weights.py`` checks the rows first (ImportError naming F4).
   Upstream: none needed.
   Remove when: never (listed so that an upgrade that reshapes them fails test_compat).
"""

from __future__ import annotations

from vllm_afd.patches.base import check_vllm_version


def apply() -> None:
    """Apply every group in this process (idempotent).

    vLLM loads general plugins in every process, so every process gets every group: front-end
    patches wrap classes a worker never calls and vice versa.
    """
    check_vllm_version()
    from vllm_afd.patches import (
        cpu_amx,
        cpu_comm,
        cpu_runner,
        dp_store,
        engine_args,
        environ,
        gpu_runner,
        health,
        layers,
        metrics_registry,
        request_errors,
    )

    environ.apply()
    engine_args.apply()
    health.apply()
    metrics_registry.apply()
    layers.apply()
    cpu_runner.apply()
    gpu_runner.apply()
    cpu_comm.apply()
    cpu_amx.apply()
    dp_store.apply()
    request_errors.apply()
