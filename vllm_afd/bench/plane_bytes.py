"""Bytes per layer and buffer memory of the A:F data plane: the slot protocol against DeepEP's
low-latency group with virtual experts (issue 19, docs/benchmarks.md).

    python -m vllm_afd.bench.plane_bytes [--tokens 128 256] [--out plane.json]

A computation, not a measurement: nothing here needs a GPU. For each model and A:F deployment
(Qwen3-30B-A3B 7+1 on one node, Qwen3-235B-A22B 28+4 on four; ``--deployment`` adds others)
and each decode microbatch of T tokens per attention rank, both planes move bf16 hidden states:

* **slots** (``transport/slot_plane.py``, the shm backend's protocol in device memory): each
  token goes once to each of the F FFN ranks, with its int32 ids and float32 weights, and
  comes back once, weighted and summed (``SlotsBackend.round_trip_bytes`` per FFN rank). Fixed
  shapes, so no filtering by expert on the host: F ranks per token, where the shm backend's
  filtered sends touch ``F (1 - C(E - E/F, k) / C(E, k))`` with uniform routing (the
  ``FFN ranks/token`` column; equal at F = 1). Memory as ``slot_plane.PlaneLayout`` lays it
  out: one FFN rank's request buffer (A attention ranks x 2 slots of T tokens), held by the
  FFN GPU, and an attention rank's answer buffers (F FFN ranks x 2 slots of T rows), held by
  the attention GPU.
* **deepep-ll** (the retired ``deepep`` backend): one row per (token, expert) each way
  (``deepep_ll_round_trip_bytes``), in a group of A + F ranks with ``(A + F) E / F``
  virtual experts; every rank of the group allocates the NVSHMEM buffer of DeepEP's
  ``get_low_latency_rdma_size_hint`` (ported below from DeepEP dd758ca,
  csrc/legacy/config.hpp ``LowLatencyLayout``), the same on attention and FFN GPUs.

The table prints per layer per attention rank (MB each way) and per GPU buffer (GiB), and the
JSON has every number. The slot plane's numbers are those of its layout and protocol; its
device layer has not run on a GPU yet unless issue 19's closing note says so.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from vllm_afd.planner.models import MODEL_PRESETS, ModelSpec
from vllm_afd.transport import TransportSpec, backend
from vllm_afd.transport.slot_plane import PlaneLayout

#: (model preset, attention GPUs, FFN GPUs): the deployments issue 19 asks about.
DEPLOYMENTS = (("qwen3-30b-a3b", 7, 1), ("qwen3-235b-a22b", 28, 4))
_DEEPEP_ALIGNMENT = 128  # LEGACY_NUM_BUFFER_ALIGNMENT_BYTES


def deepep_ll_buffer_bytes(max_tokens: int, hidden: int, num_experts: int) -> int:
    """DeepEP's ``get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts)``
    (the rank count does not enter it): odd/even send, receive and signalling buffers sized
    for every expert's worst case."""
    scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + scales * 4)  # int4 header + bf16 or fp8 row
    combine_msg = scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = max(num_experts * max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    signalling = -(-num_experts * 4 // 128) * 128
    total = 2 * (send + recv + signalling)
    return (total + _DEEPEP_ALIGNMENT) // _DEEPEP_ALIGNMENT * _DEEPEP_ALIGNMENT


def deepep_ll_round_trip_bytes(tokens: int, top_k: int, hidden: int) -> tuple[int, int]:
    """(sent, received) bytes of a low-latency dispatch and combine of ``tokens`` bf16 rows:
    one row per (token, expert) pair each way, at most; ids and weights stay behind."""
    rows = tokens * top_k * hidden * 2
    return rows, rows


def ffn_ranks_touched(num_experts: int, num_ffn: int, top_k: int) -> float:
    """Expected FFN ranks holding any of a token's ``top_k`` experts (uniform routing over
    ``num_experts`` split evenly across ``num_ffn`` ranks)."""
    held_elsewhere = num_experts - num_experts // num_ffn
    return num_ffn * (1 - math.comb(held_elsewhere, top_k) / math.comb(num_experts, top_k))


@dataclass(frozen=True)
class PlaneRow:
    model: str
    attention: int
    ffn: int
    tokens: int  #: per attention rank and microbatch
    ranks_touched: float  #: by the shm backend's filtered sends (the slot plane sends to all F)
    slots_sent_bytes: float  #: per layer per attention rank
    slots_received_bytes: float
    slots_ffn_buffer_bytes: int  #: per FFN GPU: its request buffer
    slots_attention_buffer_bytes: int  #: per attention GPU: its answer buffers
    deepep_sent_bytes: int
    deepep_received_bytes: int
    deepep_buffer_bytes: int  #: per GPU, attention and FFN alike
    virtual_experts: int


def _spec(model: ModelSpec, attention: int, ffn: int, tokens: int, name: str) -> TransportSpec:
    return TransportSpec(
        backend=name,
        num_attention_ranks=attention,
        num_ffn_ranks=ffn,
        num_experts=model.num_experts,
        hidden_size=model.hidden_size,
        top_k=model.top_k,
        max_tokens=tokens,
        dtype=torch.bfloat16,
        moe_layers=tuple(range(model.num_layers)),
    )


def plane_row(model: ModelSpec, attention: int, ffn: int, tokens: int) -> PlaneRow:
    """Both planes' bytes and buffers for one deployment and microbatch size."""
    touched = ffn_ranks_touched(model.num_experts, ffn, model.top_k)
    slots = _spec(model, attention, ffn, tokens, "slots")
    sent, received = backend("slots").round_trip_bytes(slots, tokens)
    virtual = (attention + ffn) * model.num_experts // ffn
    deepep_sent, deepep_received = deepep_ll_round_trip_bytes(
        tokens, model.top_k, model.hidden_size
    )
    return PlaneRow(
        model=model.name,
        attention=attention,
        ffn=ffn,
        tokens=tokens,
        ranks_touched=touched,
        slots_sent_bytes=sent * ffn,
        slots_received_bytes=received * ffn,
        slots_ffn_buffer_bytes=PlaneLayout.of(slots).total_bytes,
        slots_attention_buffer_bytes=ffn * PlaneLayout.of(slots).answer_bytes,
        deepep_sent_bytes=deepep_sent,
        deepep_received_bytes=deepep_received,
        deepep_buffer_bytes=deepep_ll_buffer_bytes(tokens, model.hidden_size, virtual),
        virtual_experts=virtual,
    )


def table(rows: list[PlaneRow]) -> str:
    mb, gib = 1e6, 2**30
    lines = [
        "| model | A+F | T | FFN ranks/token | slots MB out/back | deepep-ll MB out/back "
        "| traffic deepep/slots | slots buffer GiB (FFN GPU / attention GPU) "
        "| deepep-ll buffer GiB (every GPU) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (r.deepep_sent_bytes + r.deepep_received_bytes) / (
            r.slots_sent_bytes + r.slots_received_bytes
        )
        lines.append(
            f"| {r.model} | {r.attention}+{r.ffn} | {r.tokens} | {r.ranks_touched:.2f} "
            f"| {r.slots_sent_bytes / mb:.2f} / {r.slots_received_bytes / mb:.2f} "
            f"| {r.deepep_sent_bytes / mb:.2f} / {r.deepep_received_bytes / mb:.2f} "
            f"| {ratio:.1f}x | {r.slots_ffn_buffer_bytes / gib:.3f} / "
            f"{r.slots_attention_buffer_bytes / gib:.3f} "
            f"| {r.deepep_buffer_bytes / gib:.2f} |"
        )
    return "\n".join(lines)


def _deployment(text: str) -> tuple[str, int, int]:
    try:
        name, ratio = text.split("@")
        attention, ffn = (int(n) for n in ratio.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--deployment {text!r}: expected MODEL@A+F, e.g. qwen3-30b-a3b@7+1"
        ) from None
    if name not in MODEL_PRESETS:
        raise argparse.ArgumentTypeError(
            f"--deployment {text!r}: unknown model; allowed: {', '.join(MODEL_PRESETS)}"
        )
    if attention < 1 or ffn < 1 or MODEL_PRESETS[name].num_experts % ffn:
        raise argparse.ArgumentTypeError(
            f"--deployment {text!r}: A and F must be >= 1, F dividing the experts"
        )
    return name, attention, ffn


def main(argv: list[str] | None = None) -> list[PlaneRow]:
    p = argparse.ArgumentParser(prog="python -m vllm_afd.bench.plane_bytes", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 256], metavar="T")
    p.add_argument("--deployment", type=_deployment, action="append", metavar="MODEL@A+F")
    p.add_argument("--out", "--json", dest="out", metavar="PATH", help="write the rows here")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error("--tokens: every T must be >= 1")
    rows = [
        plane_row(MODEL_PRESETS[name], a, f, t)
        for name, a, f in (args.deployment or DEPLOYMENTS)
        for t in args.tokens
    ]
    print(table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return rows


if __name__ == "__main__":
    main()
