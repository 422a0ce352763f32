"""An FFN rank's routed-expert weights, read straight from the checkpoint.

Only the routed-expert tensors of this rank's experts are read (shards are picked through
``model.safetensors.index.json``); nothing else of the model (attention, embeddings, router,
shared experts) is loaded on an FFN rank. The result is vLLM's layout, one ``LayerExperts`` per
MoE layer, which every expert kernel (``ffn/kernels.py``) takes as is.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

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
