"""A live scale, front-end side: what ``POST /afd/scale`` refuses before anything starts
(``placement/scaling.py``), and who may ask (``placement/routes.py``).

The scale itself (a new pool started by Ray, the attention ranks switched under streams, the
old pool stopped) runs in tests/e2e/test_real_model_e2e.py; the attention side's switch in
tests/unit/test_pool_switch.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from vllm_afd.config import AFDConfig
from vllm_afd.placement import lifecycle, routes, scaling
from vllm_afd.placement.cluster import FFNGroup, GroupRequest
from vllm_afd.transport import TransportSpec


@pytest.fixture
def group(tiny_qwen3, monkeypatch) -> FFNGroup:
    """A running group as the front-end holds it (no process behind it): 1 FFN rank, 8 experts."""
    from transformers import AutoConfig

    from vllm_afd.config import moe_model_info

    info = moe_model_info(AutoConfig.from_pretrained(tiny_qwen3))
    spec = TransportSpec("shm", 1, 1, info.num_experts, info.hidden_size, info.top_k, 16)
    afd = AFDConfig.from_dict({"ratio": "1:1"})
    request = GroupRequest(afd, info, tiny_qwen3, 1, 16, spec.dtype)
    running = FFNGroup(spec, [], [], None, False, spec, tiny_qwen3, "cpu", request=request)
    monkeypatch.setattr(lifecycle, "_GROUP", running)
    return running


@pytest.mark.parametrize(
    ("count", "reason"),
    [
        (3, "cannot be split evenly over 3 FFN ranks"),
        (16, "has only 8 routed experts"),
        (0, "0 FFN ranks"),
        ("2", "must be an integer"),
        (True, "must be an integer"),
    ],
)
def test_a_count_the_experts_cannot_split_into_is_refused_naming_the_field(group, count, reason):
    with pytest.raises(scaling.ScaleError) as refused:
        scaling.scale_ffn_group(count)
    assert refused.value.status == 400
    assert "num_ffn_ranks" in str(refused.value) and reason in str(refused.value)
    assert "[1, 2, 4, 8]" in str(refused.value)


def test_the_size_the_pool_has_is_no_scale(group):
    assert scaling.scale_ffn_group(1) is None


def test_a_collective_backend_or_no_group_cannot_scale(group, monkeypatch):
    monkeypatch.setattr(group, "spec", dataclasses.replace(group.spec, backend="deepep"))
    with pytest.raises(scaling.ScaleError, match="deepep cannot change its FFN pool live") as e:
        scaling.scale_ffn_group(2)
    assert e.value.status == 409
    monkeypatch.setattr(lifecycle, "_GROUP", None)
    with pytest.raises(scaling.ScaleError, match="no FFN group of this front-end") as e:
        scaling.scale_ffn_group(2)
    assert e.value.status == 409


def test_one_scale_at_a_time(group):
    with scaling._SCALING:
        with pytest.raises(scaling.ScaleError, match="another scale") as busy:
            scaling.scale_ffn_group(2)
    assert busy.value.status == 409


def _client(keys: list[str], host: str) -> TestClient:
    app = FastAPI()
    app.include_router(routes.router)
    app.state.afd_api_keys = keys
    return TestClient(app, client=(host, 50000))


def test_scaling_takes_the_servers_api_key(group):
    client = _client(["s3cret"], "127.0.0.1")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        answer = client.post("/afd/scale", json={"num_ffn_ranks": 3}, headers=headers)
        assert answer.status_code == 401 and "--api-key" in answer.json()["error"]
    answer = client.post(
        "/afd/scale", json={"num_ffn_ranks": 3}, headers={"Authorization": "Bearer s3cret"}
    )
    assert answer.status_code == 400 and "num_ffn_ranks 3" in answer.json()["error"]


def test_without_an_api_key_only_loopback_may_scale(group):
    answer = _client([], "10.1.2.3").post("/afd/scale", json={"num_ffn_ranks": 2})
    assert answer.status_code == 401 and "10.1.2.3" in answer.json()["error"]
    local = _client([], "127.0.0.1")
    answer = local.post("/afd/scale", json={"num_ffn_ranks": 1})
    assert answer.status_code == 200, answer.text
    assert answer.json()["scale"] is None
    for body in ({"num_ffn_ranks": 2, "extra": 1}, [2], None):
        answer = local.post("/afd/scale", json=body)
        assert answer.status_code == 400 and "num_ffn_ranks" in answer.json()["error"]
