"""One attention rank and one FFN rank over the ``deepep`` transport, compared with the dense
reference: the GPU smoke test's data-path step (``scripts/gpu-smoke.sh``), and the steps the
CPU tests drive against the contract model.

Each step runs in vLLM's DBO order (per MoE layer: a dispatch per microbatch, then a combine
per microbatch) with MoE layers numbered as a model with a dense first layer would (1, 3), and
every combine is compared with ``reference_moe_combine`` at bfloat16 tolerance. On a GPU the
attention rank then captures a step in a CUDA graph and replays it (``graph_steps``).

    python -m vllm_afd.testing.deepep_round_trip            # real DeepEP: 2 processes, GPU 0
    python -m vllm_afd.testing.deepep_round_trip --cpu-model  # threads, the contract model

On one GPU the two processes share it (two NVSHMEM PEs on one device: whether NVSHMEM takes
that is what the GPU step finds out; with two GPUs or more each process gets its own).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from collections.abc import Sequence

import torch

from vllm_afd import envs
from vllm_afd.host import write_private_file
from vllm_afd.transport import TransportSpec, auth, deepep, group
from vllm_afd.transport.base import AttentionTransport, FFNTransport
from vllm_afd.transport.control import Mode, StepSchedule
from vllm_afd.transport.reference import LocalMoE, ScaleExperts, reference_moe_combine

LAYERS = (1, 3)
NUM_EXPERTS = 8
HIDDEN = 128  # padded to 2048 by the transport, DeepEP's smallest compiled size
#: (step, tokens per microbatch): one and two microbatches, an empty microbatch.
STEPS = ((1, (5, 3)), (2, (4,)), (3, (2, 2)), (4, (0, 3)))


def experts() -> ScaleExperts:
    return ScaleExperts(torch.arange(1, NUM_EXPERTS + 1, dtype=torch.float32) / 4)


def spec(num_attention: int, num_ffn: int, hub_address: str, max_tokens: int = 8) -> TransportSpec:
    return TransportSpec(
        "deepep",
        num_attention,
        num_ffn,
        num_experts=NUM_EXPERTS,
        hidden_size=HIDDEN,
        top_k=2,
        max_tokens=max_tokens,
        dtype=torch.bfloat16,
        addresses=(hub_address,) * num_ffn,
        moe_layers=LAYERS,
        timeout_s=30.0,
    )


def run_step(
    endpoint: AttentionTransport, step: int, tokens: Sequence[int], seed: int, device="cpu"
) -> list[tuple[torch.Tensor, ...]]:
    """One step of ``endpoint`` in DBO order; ``(x, topk_ids, topk_weights, out)`` per layer
    and microbatch."""
    endpoint.begin_step(StepSchedule(step, tuple(tokens), LAYERS))
    gen = torch.Generator().manual_seed(seed)
    done = []
    for layer in LAYERS:
        inputs, handles = [], []
        for mb, n in enumerate(tokens):
            x = torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16)
            ids = torch.randint(0, NUM_EXPERTS, (n, 2), generator=gen)
            ids[:, 1] = ids[:, 0] + 1 + torch.randint(0, NUM_EXPERTS - 1, (n,), generator=gen)
            ids[:, 1] %= NUM_EXPERTS
            w = torch.rand(n, 2, generator=gen)
            w = w / w.sum(dim=1, keepdim=True)
            x, ids, w = x.to(device), ids.to(device), w.to(device)
            inputs.append((x, ids, w))
            handles.append(endpoint.dispatch(layer, x, ids, w, mb))
        for (x, ids, w), handle in zip(inputs, handles, strict=True):
            done.append((x, ids, w, endpoint.combine(handle)))
    return done


def max_error(results: Sequence[tuple[torch.Tensor, ...]]) -> float:
    """Largest deviation from the dense reference, relative to the output's scale (raises if
    a shape or dtype is wrong)."""
    worst = 0.0
    for x, ids, w, out in results:
        if out.shape != x.shape or out.dtype != torch.bfloat16:
            raise AssertionError(
                f"combine returned {out.dtype} {tuple(out.shape)} for {tuple(x.shape)}"
            )
        want = reference_moe_combine(x.float().cpu(), ids.cpu(), w.cpu(), experts(), NUM_EXPERTS)
        if want.numel():
            scale = want.abs().max().clamp(min=1.0)
            worst = max(worst, float((out.float().cpu() - want).abs().max() / scale))
    return worst


def serve(transport: FFNTransport, ffn_rank: int, stop: threading.Event) -> None:
    """The reference FFN loop (``testing.ffn.serve_ffn``) over this rank's scaled experts."""
    from vllm_afd.testing.ffn import serve_ffn

    forward = LocalMoE.for_rank(experts(), transport.spec, ffn_rank)
    serve_ffn(transport, forward, stop.is_set)


def _secret_file() -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="vllm_afd_rt_"), "secret")
    os.environ[envs.AUTH_FILE] = write_private_file(path, auth.new_secret())
    return path


def graph_steps(endpoint: AttentionTransport, first_step: int, replays: int = 3) -> float:
    """Capture one step's dispatches and combines (every layer, one microbatch) in a CUDA
    graph, announced as a capture step (the FFN rank posts nothing), then replay it with new
    inputs, each replay announced first as patch G1 does; the largest relative error."""
    n = 4
    x = torch.zeros(n, HIDDEN, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(n, 2, dtype=torch.int64, device="cuda")
    w = torch.zeros(n, 2, dtype=torch.float32, device="cuda")
    endpoint.begin_step(StepSchedule(first_step, (n,), LAYERS, Mode.CAPTURE))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [endpoint.combine(endpoint.dispatch(layer, x, ids, w)) for layer in LAYERS]
    worst = 0.0
    for i in range(replays):
        gen = torch.Generator().manual_seed(100 + i)
        x.copy_(torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16))
        ids.copy_(torch.stack([torch.arange(n), (torch.arange(n) + 3 + i) % n + 4], dim=1))
        w.copy_(torch.full((n, 2), 0.5))
        endpoint.begin_step(StepSchedule(first_step + 1 + i, (n,), LAYERS))
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, max_error([(x, ids, w, out) for out in outs]))
    return worst


def _attention_main(spec_json: str, result) -> None:
    torch.cuda.set_device(0)
    endpoint = deepep.DeepEPAttentionTransport(TransportSpec.from_json(spec_json), 0)
    try:
        errors = [max_error(run_step(endpoint, s, t, s, "cuda")) for s, t in STEPS]
        errors.append(graph_steps(endpoint, len(STEPS) + 1))
        result.put(max(errors))
    finally:
        endpoint.close()


def _ffn_main(spec_json: str, stop) -> None:
    torch.cuda.set_device(min(1, torch.cuda.device_count() - 1))
    transport = deepep.DeepEPFFNTransport(TransportSpec.from_json(spec_json), 0)
    try:
        serve(transport, 0, stop)
    finally:
        transport.close()


def _on_gpus(hub_address: str) -> float:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    s = spec(1, 1, hub_address).to_json()
    stop, result = ctx.Event(), ctx.Queue()
    ffn = ctx.Process(target=_ffn_main, args=(s, stop), daemon=True)
    attention = ctx.Process(target=_attention_main, args=(s, result), daemon=True)
    ffn.start()
    attention.start()
    try:
        error = result.get(timeout=150)
    finally:
        stop.set()
        attention.join(30)
        ffn.join(30)
        for p in (attention, ffn):
            if p.is_alive():
                p.kill()
    return error


def _on_cpu_model(hub_address: str) -> float:
    from vllm_afd.testing import deep_ep_model

    real, deepep._import_deep_ep = deepep._import_deep_ep, lambda: deep_ep_model
    try:
        s = spec(1, 1, hub_address)
        ffn = deepep.DeepEPFFNTransport(s, 0)
        attention = deepep.DeepEPAttentionTransport(s, 0)
    finally:
        deepep._import_deep_ep = real
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(ffn, 0, stop), daemon=True)
    server.start()
    try:
        return max(max_error(run_step(attention, st, t, st)) for st, t in STEPS)
    finally:
        stop.set()
        server.join(10)
        attention.close()
        ffn.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-model", action="store_true", help="threads over the CPU model")
    args = parser.parse_args(argv)
    secret = _secret_file()
    hub = group.Hub("127.0.0.1", 2, auth.load_secret(secret))
    try:
        error = (_on_cpu_model if args.cpu_model else _on_gpus)(hub.address)
    finally:
        hub.close()
        os.unlink(secret)
        os.rmdir(os.path.dirname(secret))
    ok = error < 2e-2
    graphs = "" if args.cpu_model else " and 3 CUDA-graph replays"
    print(
        f"deepep round trip: {len(STEPS)} steps{graphs}, largest relative error {error:.2e}: "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
