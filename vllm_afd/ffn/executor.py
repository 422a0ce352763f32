"""FFN executor: one FFN rank holds a contiguous slice of every MoE layer's routed experts.

A token's journey on this side: ``transport.recv`` hands over every pending request (from any
attention rank, any layer); requests of the same layer are concatenated so the experts run
once for all attention ranks' tokens (the batching AFD exists for); the expert kernel computes
``sum_k w_k * expert_k(x)`` over this rank's experts only (the other experts' weights are
masked to zero); ``transport.reply`` sends each request its rows back. A layer served for one
request alone (decode with one attention rank) computes straight into the request's
``reply_buffer`` when the transport has one (shm), so that ``reply`` copies nothing.

Weights come straight from the checkpoint's safetensors, and only the routed-expert tensors of
this rank's experts are read (shards are picked through ``model.safetensors.index.json``).
Nothing else of the model (attention, embeddings, router, shared experts) is loaded here.

The expert kernel is vLLM's own (``cpu_fused_moe`` with the same prepacked layout on CPU), so
that AFD outputs match colocated serving bit for bit; ``TorchExperts`` is the pure-PyTorch
reference the fast kernels are tested against.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_afd.metrics import FFNStatsBlock
from vllm_afd.transport import FFNRequest, FFNTransport, TransportSpec, create_ffn_transport

# Per-expert tensors: ``...layers.{L}.<block>.experts.{e}.{proj}.weight`` where proj is the
# gate/up/down projection under the two naming families in use (Qwen/DeepSeek, Mixtral).
_EXPERT_RE = re.compile(
    r"^(?:.*\.)?layers\.(\d+)\.(?:[\w.]*\.)?experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_PROJ = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


def expert_range(rank: int, num_ranks: int, num_experts: int) -> range:
    """Global expert ids owned by FFN ``rank`` (contiguous placement)."""
    per_rank = num_experts // num_ranks
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclass
class LayerExperts:
    """Routed experts of one layer held by this rank (vLLM's layout).

    w13: ``[E_local, 2I, H]`` gate rows then up rows; w2: ``[E_local, H, I]``.
    """

    w13: torch.Tensor
    w2: torch.Tensor


def _checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index if there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files.update({name: path for name in f.keys()})  # noqa: SIM118
    return files


def load_routed_experts(
    model_dir: str | Path, experts: range, dtype: torch.dtype
) -> dict[int, LayerExperts]:
    """Read the routed-expert tensors of ``experts`` for every MoE layer.

    Returns layer index -> ``LayerExperts``. Raises ``ValueError`` if the checkpoint has no
    per-expert tensors this loader understands.
    """
    from safetensors import safe_open

    wanted: dict[Path, list[tuple[str, int, int, str]]] = defaultdict(list)
    for name, path in _checkpoint_files(Path(model_dir)).items():
        match = _EXPERT_RE.match(name)
        if match and "shared_expert" not in name and int(match.group(2)) in experts:
            layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
            wanted[path].append((name, layer, expert - experts.start, _PROJ[proj]))
    if not wanted:
        raise ValueError(
            f"{model_dir}: no routed-expert tensors named like "
            "'model.layers.L.mlp.experts.E.gate_proj.weight' (or w1/w2/w3) were found"
        )
    parts: dict[tuple[int, int, str], torch.Tensor] = {}
    for path, names in wanted.items():
        with safe_open(str(path), framework="pt") as f:
            for name, layer, local, proj in names:
                parts[(layer, local, proj)] = f.get_tensor(name).to(dtype)
    return _stack_layers(parts, len(experts))


def _stack_layers(
    parts: dict[tuple[int, int, str], torch.Tensor], num_local: int
) -> dict[int, LayerExperts]:
    layers = sorted({layer for layer, _, _ in parts})
    out = {}
    for layer in layers:
        w13 = [
            torch.cat([parts[(layer, e, "gate")], parts[(layer, e, "up")]])
            for e in range(num_local)
        ]
        w2 = [parts[(layer, e, "down")] for e in range(num_local)]
        out[layer] = LayerExperts(torch.stack(w13).contiguous(), torch.stack(w2).contiguous())
    return out


def localize_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: range
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global expert ids to this rank's local ids; zero the weight of foreign experts.

    Returns ``(local_ids int32 [N, K], weights float32 [N, K])``; foreign experts point at
    local expert 0 with weight 0, so they add exactly nothing.
    """
    local = topk_ids.to(torch.int64) - experts.start
    foreign = (local < 0) | (local >= len(experts))
    weights = topk_weights.to(torch.float32).masked_fill(foreign, 0.0)
    return local.masked_fill(foreign, 0).to(torch.int32), weights


class TorchExperts:
    """Pure-PyTorch reference: ``out[t] = sum_k w[t,k] * down(silu(gate x) * up x)``.

    Runs on ``device`` (weights are moved there once; inputs and the answer cross per call),
    which makes it the correct-but-slow expert kernel of a CUDA FFN rank until a grouped-GEMM
    kernel is wired in (not run on a GPU yet).
    """

    def __init__(self, layers: dict[int, LayerExperts], device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.layers = {
            layer: LayerExperts(w.w13.to(self.device), w.w2.to(self.device))
            for layer, w in layers.items()
        }

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        local_ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[N, H]`` in ``x.dtype``; written into ``out`` (and returned) when given."""
        if x.device != self.device:
            y = self(layer, x.to(self.device), local_ids.to(self.device), weights.to(self.device))
            return y.to(x.device) if out is None else out.copy_(y)
        experts = self.layers[layer]
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in torch.unique(local_ids[weights != 0]).tolist():
            rows, slots = torch.nonzero((local_ids == e) & (weights != 0), as_tuple=True)
            h = x[rows].float() @ experts.w13[e].float().t()
            gate, up = h.chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ experts.w2[e].float().t()
            acc.index_add_(0, rows, y * weights[rows, slots, None])
        return acc.to(x.dtype) if out is None else out.copy_(acc)


class VllmCpuExperts:
    """vLLM's CPU grouped-GEMM MoE kernel with vLLM's prepacked weight layout."""

    def __init__(self, layers: dict[int, LayerExperts], dtype: torch.dtype) -> None:
        from vllm._custom_ops import cpu_prepack_moe_weight

        self.isa = _cpu_isa(dtype)
        self.layers = {
            layer: LayerExperts(
                cpu_prepack_moe_weight(_pad_w13(w.w13), self.isa),
                cpu_prepack_moe_weight(_pad_w2(w.w2), self.isa),
            )
            for layer, w in layers.items()
        }

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        local_ids: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[N, H]`` in ``x.dtype``; written into ``out`` (and returned) when given."""
        from vllm._custom_ops import cpu_fused_moe

        experts = self.layers[layer]
        if out is None:
            out = torch.empty_like(x)
        cpu_fused_moe(
            out, x, experts.w13, experts.w2, None, None, weights, local_ids, "silu", self.isa
        )
        return out


def _cpu_isa(dtype: torch.dtype) -> str:
    """The ISA vLLM's CPU experts pick for this dtype (see vllm experts/cpu_moe.py)."""
    import platform

    if dtype == torch.bfloat16 and platform.machine() in ("x86_64", "AMD64"):
        if torch.cpu._is_amx_tile_supported():
            return "amx"
    if dtype == torch.bfloat16 and platform.machine() in ("aarch64", "arm64"):
        return "neon"
    return "vec"


def _padded(size: int, multiple: int = 32) -> int:
    return (size + multiple - 1) // multiple * multiple


def _pad_w13(w13: torch.Tensor) -> torch.Tensor:
    """Zero-pad the intermediate dim of ``[E, 2I, H]`` to vLLM's CPU alignment (gate | up)."""
    inter = w13.shape[1] // 2
    padded = _padded(inter)
    if padded == inter:
        return w13
    out = w13.new_zeros(w13.shape[0], 2 * padded, w13.shape[2])
    out[:, :inter] = w13[:, :inter]
    out[:, padded : padded + inter] = w13[:, inter:]
    return out


def _pad_w2(w2: torch.Tensor) -> torch.Tensor:
    inter = w2.shape[2]
    if _padded(inter) == inter:
        return w2
    out = w2.new_zeros(w2.shape[0], w2.shape[1], _padded(inter))
    out[:, :, :inter] = w2
    return out


def make_expert_kernel(layers: dict[int, LayerExperts], device: str, dtype: torch.dtype):
    """Pick the expert kernel for ``device``: ``cpu`` (vLLM's CPU kernel), ``cuda`` (the
    PyTorch reference on the GPU), ``torch`` (the reference on the CPU)."""
    if device == "cpu":
        return VllmCpuExperts(layers, dtype)
    if device == "cuda":
        return TorchExperts(layers, "cuda")
    if device == "torch":
        return TorchExperts(layers)
    raise ValueError(f"FFN device {device!r}; allowed: cpu, cuda, torch")


@dataclass
class FFNStats:
    """Counters the attention side and /metrics read (cumulative).

    ``shared``, when set, is this rank's stats block in shared memory (``vllm_afd.metrics``):
    ``FFNExecutor._account`` writes the same numbers there, where ``/metrics`` reads them.
    """

    requests: int = 0
    tokens: int = 0
    bytes_in: int = 0
    busy_s: float = 0.0
    per_layer_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    per_layer_calls: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    shared: FFNStatsBlock | None = field(default=None, repr=False, compare=False)

    def snapshot(self) -> dict:
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "bytes_in": self.bytes_in,
            "busy_s": self.busy_s,
            "per_layer_s": dict(self.per_layer_s),
            "per_layer_calls": dict(self.per_layer_calls),
        }


def _open_stats_block(address: str, rank: int, layers) -> FFNStatsBlock | None:
    """This rank's shared stats block for /metrics, or None (logged) if it cannot be made:
    metrics never keep an FFN rank from serving."""
    try:
        return FFNStatsBlock(address, rank, layers)
    except Exception as exc:  # noqa: BLE001
        logging.getLogger("vllm.afd").warning("AFD metrics disabled for FFN rank %d: %s", rank, exc)
        return None


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The requests' rows stacked (no copy for a single request)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class FFNExecutor:
    """One FFN rank: its experts, its transport endpoint, and the serve loop."""

    def __init__(self, spec: TransportSpec, rank: int, model_dir: str, device: str) -> None:
        self.spec, self.rank = spec, rank
        self.experts = expert_range(rank, spec.num_ffn_ranks, spec.num_experts)
        layers = load_routed_experts(model_dir, self.experts, spec.dtype)
        self.param_bytes = sum(w.w13.nbytes + w.w2.nbytes for w in layers.values())
        self.kernel = make_expert_kernel(layers, device, spec.dtype)
        self.transport: FFNTransport = create_ffn_transport(spec, rank)
        self.stats = FFNStats(shared=_open_stats_block(self.transport.address, rank, layers))
        # Wire bytes per token besides the hidden state: int32 expert ids + float32 weights.
        self._routing_bytes = spec.top_k * 8
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()

    @property
    def address(self) -> str:
        return self.transport.address

    def serve_once(self, timeout_s: float) -> int:
        """Serve every pending request; returns how many were answered."""
        requests = self.transport.recv(timeout_s)
        by_layer: dict[int, list[FFNRequest]] = defaultdict(list)
        for request in requests:
            by_layer[request.layer].append(request)
        for layer, group in by_layer.items():
            self._serve_layer(layer, group)
        return len(requests)

    def _serve_layer(self, layer: int, group: list[FFNRequest]) -> None:
        start = time.perf_counter()
        x = _rows([r.x for r in group])
        ids = _rows([r.topk_ids for r in group])
        w = _rows([r.topk_weights for r in group])
        local_ids, weights = localize_routing(ids, w, self.experts)
        into = group[0].reply_buffer if len(group) == 1 else None
        out = (
            self.kernel(layer, x, local_ids, weights, into) if x.shape[0] else x.new_empty(x.shape)
        )
        if out is into:
            self.transport.reply(group[0], out)  # already in place: reply copies nothing
        else:
            offset = 0
            for request in group:
                n = request.x.shape[0]
                self.transport.reply(request, out[offset : offset + n])
                offset += n
        self._account(layer, group, x, time.perf_counter() - start)

    def _account(self, layer: int, group: list[FFNRequest], x: torch.Tensor, dt: float) -> None:
        s = self.stats
        s.requests += len(group)
        s.tokens += x.shape[0]
        s.bytes_in += x.nbytes
        s.busy_s += dt
        s.per_layer_s[layer] += dt
        s.per_layer_calls[layer] += 1
        if s.shared is not None:
            n = x.shape[0]
            s.shared.record_layer(
                layer, len(group), n, x.nbytes + n * self._routing_bytes, x.nbytes, dt
            )

    def serve_forever(self) -> None:
        # The expert kernels open OpenMP teams of this thread's size, which a new thread takes
        # from OMP_NUM_THREADS or the CPUs it may run on, not from the creator's
        # torch.set_num_threads: a team larger than the CPUs the rank is bound to time-slices
        # one CPU (28 ms a call instead of 50 us, measured).
        torch.set_num_threads(self._threads)
        while not self._stop.is_set():
            self.serve_once(timeout_s=0.2)

    def start(self) -> None:
        """Serve on a daemon thread (the process keeps answering control calls)."""
        self._thread = threading.Thread(target=self.serve_forever, name="afd-ffn", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.transport.close()
        if self.stats.shared is not None:
            self.stats.shared.close()

    def info(self) -> dict:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "experts": [self.experts.start, self.experts.stop],
            "param_bytes": self.param_bytes,
            "address": self.address,
            "cpus": sorted(os.sched_getaffinity(0)),
        }
