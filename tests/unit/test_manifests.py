"""The deployment manifests (deploy/) load, and their vLLM command lines pass the product's
start-up checks for the node they are written for (8 GPUs, Qwen3-30B-A3B), with no cluster:
vLLM's own parser with the plugin, ``deployment.prepare_engine_args`` (what ``vllm serve``
makes of the flags on GPUs) and ``deployment.check_devices``; and the probes, secrets and
grace period an operator relies on (docs/operations.md)."""

from __future__ import annotations

import argparse
import re
import shlex
import tempfile
from pathlib import Path

import yaml

from vllm_afd.config import AFDConfig, MoEModelInfo

ROOT = Path(__file__).parents[2]
QWEN3_30B = MoEModelInfo("Qwen3MoeForCausalLM", 48, 128, 8, 2048, 768, tuple(range(48)))


def _checked(
    parser, argv: list[str], monkeypatch, total: int = 8
) -> tuple[argparse.Namespace, AFDConfig]:
    """``vllm serve ARGV`` on an 8-GPU node: parsed, prepared as the front-end prepares it,
    and through the device checks (``AFDConfigError`` if any fails)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from vllm_afd import deployment

    args = parser.parse_args(["serve", *argv])
    with tempfile.TemporaryDirectory() as local:  # vLLM resolves no model
        engine_args = AsyncEngineArgs.from_cli_args(
            argparse.Namespace(**{**vars(args), "model": local})
        )
    monkeypatch.setattr(deployment, "_attention_device", lambda: "cuda")
    monkeypatch.setenv(deployment.V2_RUNNER_ENV, "")  # prepare sets it: teardown restores it
    monkeypatch.delenv(deployment.V2_RUNNER_ENV)
    deployment.prepare_engine_args(engine_args, UsageContext.OPENAI_API_SERVER)
    afd = AFDConfig.of(engine_args)
    ranks = engine_args.data_parallel_size * engine_args.tensor_parallel_size
    deployment.check_devices(afd, ranks, "cuda", gpus_on_node=8)
    assert ranks + afd.num_ffn_ranks(ranks) == total
    return args, afd


def test_the_leaderworkerset_serves_with_probes_a_secret_and_a_drain(serve_parser, monkeypatch):
    path = ROOT / "deploy" / "kubernetes" / "lws-qwen3-30b-a3b-7to1.yaml"
    manifest = yaml.safe_load(path.read_text())
    assert manifest["kind"] == "LeaderWorkerSet"
    pod = manifest["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["vllm", "serve"]
    args, afd = _checked(serve_parser, container["args"], monkeypatch)
    assert afd.transport == "slots" and afd.ratio == (7, 1)
    assert args.api_server_count == 1  # draining with DP needs one API server
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e for e in container["env"]}
    assert "afd" in env["VLLM_PLUGINS"]["value"].split(",")  # /afd/ready is served
    assert "secretKeyRef" in env["VLLM_API_KEY"]["valueFrom"]  # off loopback: authenticated
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/afd/ready"
    port = container["ports"][0]["containerPort"]
    assert args.port == port == container["readinessProbe"]["httpGet"]["port"]


def test_the_dynamo_worker_takes_afd_through_additional_config(serve_parser, monkeypatch):
    path = ROOT / "deploy" / "dynamo" / "qwen3-30b-a3b-afd-worker.sh"
    command = re.search(r"exec (python -m dynamo\.vllm .*?)\n(?!\s)", path.read_text(), re.S)
    argv = shlex.split(command.group(1).replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "dynamo.vllm"]
    vllm_args = argv[3:]
    model = vllm_args.pop(vllm_args.index("--model") + 1)
    vllm_args.remove("--model")
    args, afd = _checked(serve_parser, [model, *vllm_args], monkeypatch)
    assert args.data_parallel_size == 7 and afd.ratio == (7, 1)


def test_a_data_parallel_size_of_1_given_is_kept_and_refused_by_the_ratio(
    serve_parser, monkeypatch
):
    """``--afd-ratio 2:1`` alone gets two data-parallel attention ranks; with
    ``--data-parallel-size 1`` given, the 1 is the user's, and the ratio check refuses it (exit
    2 naming both) instead of silently starting two engines."""
    import pytest

    from vllm_afd.errors import AFDConfigError

    model = "Qwen/Qwen3-30B-A3B"
    args, afd = _checked(serve_parser, [model, "--afd-ratio", "2:1"], monkeypatch, total=3)
    assert afd.ratio == (2, 1)
    with pytest.raises(AFDConfigError, match=r"2:1 does not divide the 1 attention rank"):
        _checked(
            serve_parser,
            [model, "--afd-ratio", "2:1", "--data-parallel-size", "1"],
            monkeypatch,
            total=3,
        )
