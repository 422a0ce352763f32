"""AFD as the decode pool behind a stock vLLM prefill instance, through vLLM's own KV connector.

One stock (colocated, no AFD) prefill server for the module, ``ExampleConnector`` as
``kv_producer``, writes each prompt's KV into a shared directory; AFD decode instances
(``kv_consumer``) load it and continue: offline (``LLM``, AFD 1:1) and through the OpenAI server
(``--afd-ratio 2:1 --afd-transport slots``: two data-parallel attention ranks, stepped together,
and one FFN rank serving their steps on the slot plane, the GPU data plane's protocol; a 1:1 server
was dropped to keep the full tier short: the offline run covers 1:1, its FFN token count exact).
Each request goes the way vLLM's disaggregated proxy sends it (prefill with ``max_tokens=1`` and
``kv_transfer_params``, then the full request to the decode instance).

Asserted: the decode instance's greedy tokens equal the prefill server's own full completion
(a colocated stock server); the KV was loaded, not recomputed: vLLM counts the loaded tokens
(``num_cached_tokens``, ``usage.prompt_tokens_details.cached_tokens``,
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``), and the FFN group, which
sees every token any attention rank computes, served only the prompts' uncached tails and the
decode steps, never the loaded prompt tokens.

The NixlConnector variant (74 s) is marked ``optional``: outside the full tier's 30-minute
budget, run by ``make test-optional`` (``make venv`` installs NIXL).
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest
from serverlib import Server, http_request

from vllm_afd.bench.offline_run import run_generation

pytestmark = [pytest.mark.slow, pytest.mark.full]

#: vLLM's CPU attention needs a multiple of 32; prefill and decode must use the same.
BLOCK = 32
MAX_TOKENS = 12
PROMPTS = [
    "The attention ranks keep the KV cache while the FFN ranks hold experts " * 6,
    "def f(x):\n    return x * 2\n" * 10,
    "hello world " * 20,
]


def loaded_tokens(prompt_len: int) -> int:
    """What ExampleConnector loads: whole blocks of the prompt minus its last token."""
    return (prompt_len - 2) // BLOCK * BLOCK


def kv_flags(connector: str, role: str, store=None) -> tuple[str, ...]:
    config = {"kv_connector": connector, "kv_role": role}
    if store is not None:
        config["kv_connector_extra_config"] = {"shared_storage_path": str(store)}
    return ("--kv-transfer-config", json.dumps(config), "--block-size", str(BLOCK))


def proxy_prefill(prefill: Server, prompt: str) -> dict:
    """The proxy's first leg (vLLM's toy_proxy_server): max_tokens=1 on the prefill instance;
    its kv_transfer_params (NixlConnector) go with the request to the decode instance."""
    body = {
        "model": prefill.model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    status, reply = http_request(prefill.url + "/v1/completions", body, timeout=120)
    assert status == 200, reply
    return reply.get("kv_transfer_params") or {}


def decode(server: Server, prompt: str, kv_transfer_params: dict) -> dict:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    status, reply = http_request(server.url + "/v1/completions", body, timeout=120)
    assert status == 200, reply
    return reply


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series over the lines whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stop(server: Server) -> None:
    """SIGTERM, as an operator stops it: exit 0 and, within 30 s, no process left (a server
    that had already exited has failed its test already: its status is not asserted again)."""
    try:
        running = server.proc.poll() is None
        server.terminate()
        if running:
            assert server.proc.returncode == 0, server.log.read_text()[-3000:]
        server.assert_nothing_left(30)
    finally:
        server.kill_leftovers()


@pytest.fixture(scope="module")
def kv_store(tmp_path_factory):
    return tmp_path_factory.mktemp("kv_store")


@pytest.fixture(scope="module")
def prefill(tiny_qwen3, kv_store, tmp_path_factory):
    """The stock prefill instance. It schedules each prompt whole (ExampleConnector saves
    the blocks of a request's first step only: a chunked prompt would be saved in part)."""
    srv = Server(
        tiny_qwen3,
        tmp_path_factory.mktemp("prefill") / "prefill.log",
        extra=kv_flags("ExampleConnector", "kv_producer", kv_store),
        max_num_batched_tokens=512,
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        stop(srv)


@pytest.fixture(scope="module")
def reference(prefill):
    """Prefill every prompt as the proxy does, then the colocated answer: the prefill
    server (stock vLLM holding every expert) asked for the whole completion."""
    tokens = []
    for prompt in PROMPTS:
        proxy_prefill(prefill, prompt)
        status, body = prefill.complete(prompt, MAX_TOKENS)
        assert status == 200, body
        tokens.append(body["choices"][0]["token_ids"])
    return tokens


def test_offline_afd_decode_loads_the_prefill_kv(tiny_qwen3, kv_store, reference, decoder):
    """(``decoder``: the next test's server starts while this one runs offline.)"""
    job = {
        "model": tiny_qwen3,
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "afd": {"ratio": "1:1"},  # default microbatches (2): the decode steps are split
        "max_num_batched_tokens": 64,
        "warmup": False,  # every prompt's KV must come from the prefill instance
        "engine_args": {
            "block_size": BLOCK,
            "kv_transfer_config": {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"shared_storage_path": str(kv_store)},
            },
        },
    }
    result = run_generation(job)
    assert result["token_ids"] == reference
    lens = result["prompt_lens"]
    assert result["num_cached_tokens"] == [loaded_tokens(n) for n in lens]
    assert all(c > 0 for c in result["num_cached_tokens"])
    # The FFN rank saw each prompt's uncached tail and the decode steps, nothing else.
    (ffn,) = result["ffn"]
    computed = sum(n - loaded_tokens(n) for n in lens) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert ffn["tokens"] // 2 == computed, ffn  # two MoE layers


@pytest.fixture(scope="module")
def decoder(tiny_qwen3, kv_store, tmp_path_factory):
    """The AFD decode instance, 2:1 on the slot plane (the GPU data plane's protocol, on host
    memory): two data-parallel attention ranks, which vLLM steps together (an idle one with a
    dummy batch), and one FFN rank serving a step of both at once. Started, not yet healthy:
    ``test_server_afd_decode_pool_behind_stock_prefill`` waits for it."""
    server = Server(
        tiny_qwen3,
        tmp_path_factory.mktemp("decode") / "decode_2_1.log",
        extra=(
            *kv_flags("ExampleConnector", "kv_consumer", kv_store),
            "--afd-ratio",
            "2:1",
            "--afd-transport",
            "slots",
            "--enable-prompt-tokens-details",
        ),
    )
    try:
        yield server
    finally:
        stop(server)


def test_server_afd_decode_pool_behind_stock_prefill(decoder, prefill, reference):
    decoder.wait_healthy()
    log = decoder.log.read_text()
    assert "AFD: decode instance of a disaggregated deployment" in log
    assert "2 data-parallel attention ranks" in log

    def one(prompt: str) -> dict:
        return decode(decoder, prompt, proxy_prefill(prefill, prompt))

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(one, PROMPTS))
    lens = [r["usage"]["prompt_tokens"] for r in replies]
    for reply, expected, n in zip(replies, reference, lens, strict=True):
        assert reply["choices"][0]["token_ids"] == expected
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded_tokens(n)
    status, metrics = http_request(decoder.url + "/metrics")
    assert status == 200
    by_source = "vllm:prompt_tokens_by_source_total"
    loaded = sum(loaded_tokens(n) for n in lens)
    assert metric_sum(metrics, by_source, source="external_kv_transfer") == loaded
    assert metric_sum(metrics, by_source, source="local_compute") == sum(lens) - loaded
    # Tokens through the FFN group (layer 0): the tails and the decode steps, and the idle
    # data-parallel rank's one-token dummy steps. Never the loaded prompts.
    ffn_tokens = metric_sum(metrics, "vllm_afd_ffn_tokens_total", layer="0")
    computed = sum(lens) - loaded + len(PROMPTS) * (MAX_TOKENS - 1)
    assert computed <= ffn_tokens < computed + loaded


@pytest.mark.optional
def test_nixl_connector_afd_decode_behind_stock_prefill(tiny_qwen3, tmp_path):
    """NixlConnector on CPU (host buffers, UCX memory to memory): a second stock prefill
    instance and an AFD 1:1 decode instance, both kv_both; the proxy hands the prefill's
    kv_transfer_params to the decode, which pulls the blocks. Skipped where NIXL is not
    installed (a broken install fails instead)."""
    pytest.importorskip("nixl._api", reason="nixl not installed (pip install -e '.[pd]')")
    nixl_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "UCX_TLS": "tcp,self,sm"}
    flags = (
        "--kv-transfer-config",
        json.dumps(
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        ),
        "--block-size",
        str(BLOCK),
    )
    from vllm_afd.host import free_port

    prefill = Server(
        tiny_qwen3,
        tmp_path / "nixl_prefill.log",
        extra=flags,
        max_num_batched_tokens=512,
        env={**nixl_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )
    server = Server(
        tiny_qwen3,
        tmp_path / "nixl_decode.log",
        extra=(*flags, "--afd-ratio", "1:1", "--enable-prompt-tokens-details"),
        env={**nixl_env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
    )
    try:
        prefill.wait_healthy()
        server.wait_healthy()
        for prompt in PROMPTS:
            status, body = prefill.complete(prompt, MAX_TOKENS)  # the colocated answer
            assert status == 200, body
            expected = body["choices"][0]["token_ids"]
            params = proxy_prefill(prefill, prompt)
            assert params.get("remote_block_ids"), params
            reply = decode(server, prompt, params)
            assert reply["choices"][0]["token_ids"] == expected
            n = reply["usage"]["prompt_tokens"]
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - BLOCK
        metrics = http_request(server.url + "/metrics")[1]
        assert metric_sum(
            metrics, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
        )
        assert not re.search(r"Traceback", server.log.read_text())
    finally:
        stop(server)
        stop(prefill)
