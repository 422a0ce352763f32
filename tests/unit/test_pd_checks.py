"""Disaggregated prefill/decode: the start-up refusal of KV connectors AFD's microbatches
cannot run with, and the warning of what prefill and decode instances must share."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_afd.config import check_supported, kv_connectors
from vllm_afd.deployment import log_kv_transfer_requirements
from vllm_afd.errors import AFDConfigError


def _kv(connector: str | None, role: str = "kv_consumer", **extra):
    return SimpleNamespace(
        kv_connector=connector,
        kv_role=role,
        kv_connector_extra_config=extra,
        kv_buffer_device="cpu",
    )


def _vllm_config(kv, microbatches: int = 2):
    return SimpleNamespace(
        additional_config={"afd": {"ratio": "1:1", "microbatches": microbatches}},
        kv_transfer_config=kv,
        use_v2_model_runner=False,
        lora_config=None,
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, enable_eplb=False, tensor_parallel_size=1
        ),
        model_config=SimpleNamespace(
            model="/models/m",
            dtype="torch.float32",
            max_model_len=512,
            supports_multimodal_inputs=False,
            uses_mrope=False,
            runner_type="generate",
        ),
        cache_config=SimpleNamespace(block_size=32, cache_dtype="auto"),
    )


@pytest.mark.parametrize("name", ["ExampleConnector", "NixlConnector", "DecodeBenchConnector"])
def test_connectors_that_tolerate_microbatches_run_with_them(name):
    check_supported(_vllm_config(_kv(name)))


def test_a_layerwise_connector_with_microbatches_is_refused_naming_both_flags():
    with pytest.raises(AFDConfigError) as err:
        check_supported(_vllm_config(_kv("LMCacheConnectorV1")))
    message = str(err.value)
    assert "--afd-microbatches" in message and "--kv-transfer-config" in message
    assert "LMCacheConnectorV1" in message and "--afd-microbatches 1" in message
    check_supported(_vllm_config(_kv("LMCacheConnectorV1"), microbatches=1))


def test_multi_connector_members_are_checked():
    multi = _kv(
        "MultiConnector",
        connectors=[{"kv_connector": "NixlConnector"}, {"kv_connector": "LMCacheConnectorV1"}],
    )
    assert kv_connectors(SimpleNamespace(kv_transfer_config=multi)) == [
        "MultiConnector",
        "NixlConnector",
        "LMCacheConnectorV1",
    ]
    with pytest.raises(AFDConfigError, match="LMCacheConnectorV1"):
        check_supported(_vllm_config(multi))


def test_no_connector_no_check_and_no_warning(caplog):
    check_supported(_vllm_config(None))
    check_supported(_vllm_config(_kv(None)))
    with caplog.at_level(logging.WARNING, logger="vllm.afd"):
        log_kv_transfer_requirements(_vllm_config(_kv(None)))
    assert not caplog.records


def test_warning_lists_what_prefill_and_decode_must_share(caplog):
    kv = _kv("ExampleConnector", shared_storage_path="/shared/kv")
    with caplog.at_level(logging.WARNING, logger="vllm.afd"):
        log_kv_transfer_requirements(_vllm_config(kv))
    (record,) = caplog.records
    text = record.getMessage()
    assert text.startswith("AFD: decode instance of a disaggregated deployment")
    for shared in (
        "/models/m",
        "--dtype float32",
        "--kv-cache-dtype auto",
        "--block-size 32",
        "KV layout",
        "shared_storage_path /shared/kv",
        "--max-num-batched-tokens",
    ):
        assert shared in text
