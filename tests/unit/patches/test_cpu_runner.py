"""M1's configuration of a CPU model runner, on a stand-in runner (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_afd.errors import AFDConfigError
from vllm_afd.patches import cpu_runner


def _runner(afd: dict | None, **overrides) -> SimpleNamespace:
    model = SimpleNamespace(
        hf_text_config=SimpleNamespace(hidden_act="silu"),
        quantization=None,
        supports_multimodal_inputs=False,
        uses_mrope=False,
        runner_type="generate",
        use_mla=False,
    )
    parallel = SimpleNamespace(
        pipeline_parallel_size=1,
        enable_eplb=False,
        ubatch_size=0,
        dbo_decode_token_threshold=32,
        dbo_prefill_token_threshold=512,
    )
    vllm_config = SimpleNamespace(
        additional_config={"afd": afd} if afd else {},
        model_config=model,
        parallel_config=parallel,
        use_v2_model_runner=False,
        speculative_config=None,
        lora_config=None,
    )
    for key, value in overrides.items():
        setattr(vllm_config, key, value)
    return SimpleNamespace(
        vllm_config=vllm_config,
        parallel_config=parallel,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
    )


@pytest.mark.parametrize("afd", [None, {"ratio": "1:1", "microbatches": 1}])
def test_m1_leaves_the_runner_alone_without_microbatches(afd):
    runner = _runner(afd)
    assert cpu_runner.configure_runner(runner) == 1
    assert runner.parallel_config.ubatch_size == 0


def test_m1_turns_vllm_microbatching_on_for_decode_steps():
    runner = _runner({"ratio": "1:1", "microbatches": 3})
    assert cpu_runner.configure_runner(runner) == 3
    parallel = runner.parallel_config
    assert parallel.ubatch_size == 3 and parallel.dbo_decode_token_threshold == 3
    assert parallel.dbo_prefill_token_threshold == 65  # above max_num_batched_tokens


def test_m1_runs_an_mla_model_with_one_microbatch():
    """MLA models fall back to one microbatch (their CPU attention differs when split)."""
    runner = _runner({"ratio": "1:1", "microbatches": 2})
    runner.vllm_config.model_config.use_mla = True
    assert cpu_runner.configure_runner(runner) == 1
    assert runner.parallel_config.ubatch_size == 0


def test_m1_refuses_what_microbatching_cannot_run():
    runner = _runner({"ratio": "1:1", "microbatches": 2}, lora_config=object())
    with pytest.raises(AFDConfigError, match="microbatching is not supported with LoRA"):
        cpu_runner.configure_runner(runner)


def test_m7_gives_each_microbatch_its_own_shared_expert_slot():
    from types import SimpleNamespace

    from vllm_afd.config import MAX_MICROBATCHES
    from vllm_afd.microbatch import PingPong
    from vllm_afd.patches.cpu_runner import _microbatch_output_idx, _patch_shared_experts_init

    def stock_init(self):
        self._output = [None, None]

    layer = SimpleNamespace()
    _patch_shared_experts_init(stock_init)(layer)
    assert layer._output == [None] * MAX_MICROBATCHES
    output_idx = _microbatch_output_idx(lambda self: 0)  # vLLM's choice without DBO
    assert output_idx(layer) == 0  # outside a microbatched step
    pool = PingPong(3)
    try:
        assert pool.run([lambda: output_idx(layer)] * 3) == [0, 1, 2]
    finally:
        pool.close()
