#!/usr/bin/env bash
# GPU smoke test of vllm-afd: one script, every step under its own timeout, one PASS/FAIL/SKIP
# line per step, a summary at the end; exit status 1 if any step failed. Meant for a machine
# with one or more NVIDIA GPUs and vLLM's GPU build (vllm==0.33.x) in the active environment
# (or PYTHON=/path/to/python); runs in well under 8 minutes on one H200.
#
# What it covers today (docs/architecture.md, "The GPU path"): the plugin loads and its patch
# ledger accepts the GPU build's vLLM; the platform is seen as CUDA and the start-up refusals
# fire there (shm/tcp with a CUDA model, A + F over the node's GPUs, DeepEP's limits); DeepEP
# imports and builds a low-latency buffer in a one-rank group; the deepep transport's data path
# (one attention and one FFN process sharing GPU 0, or one GPU each: steps of one and two
# microbatches and CUDA-graph replays against the dense reference, vllm_afd.testing.
# deepep_round_trip). What it does not cover yet: vLLM serving with AFD on GPUs end to end.
# The slot plane that is to replace deepep on the A:F hop has its own check, PyTorch and Triton
# only (no vLLM): python -m vllm_afd.testing.slot_plane_check.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODEL_DIR=${MODEL_DIR:-/tmp/vllm_afd_gpu_smoke_model}
LOG_DIR=${LOG_DIR:-/tmp/vllm_afd_gpu_smoke}
mkdir -p "$LOG_DIR"
export VLLM_HOST_IP=127.0.0.1
failed=0

step() {  # step NAME TIMEOUT_S COMMAND...: run COMMAND, print one line, keep its log
    local name=$1 limit=$2
    shift 2
    local log="$LOG_DIR/$name.log" start=$SECONDS rc
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
        echo "PASS $name ($((SECONDS - start)) s)"
    elif [ $rc -eq 77 ]; then
        echo "SKIP $name: $(tail -n 1 "$log")"
    else
        [ $rc -eq 124 ] && echo "FAIL $name: timed out after ${limit} s" \
            || echo "FAIL $name (exit $rc): $(tail -n 3 "$log" | tr '\n' ' ' | cut -c1-300)"
        failed=1
    fi
}

step gpu-visible 60 $PY -c "
import torch, vllm
assert torch.cuda.is_available(), 'no CUDA device'
print(vllm.__version__, torch.__version__, torch.cuda.device_count(), torch.cuda.get_device_name(0))
"

if [ $failed -ne 0 ]; then
    echo "GPU SMOKE: FAIL (no usable GPU: the other steps were not run; logs: $LOG_DIR)"
    exit 1
fi

step plugin-loads 120 $PY -c "
import vllm_afd
vllm_afd.register()  # applies every patch; the ledger checks vLLM's version and targets
from vllm.platforms import current_platform
assert not current_platform.is_cpu(), 'vLLM sees no GPU platform'
print('patches applied on', current_platform.device_name)
"

step tiny-model 180 $PY -m vllm_afd.cli tiny-model "$MODEL_DIR" --dtype bfloat16

step refuses-shm-for-cuda 300 $PY - "$MODEL_DIR" <<'PYEOF'
import subprocess, sys
out = subprocess.run(
    [sys.executable, "-m", "vllm_afd.cli", "serve", sys.argv[1], "--afd-ratio", "1:1",
     "--host", "127.0.0.1", "--port", "1"],
    capture_output=True, text=True, timeout=280,
)
text = out.stdout + out.stderr
assert out.returncode == 2, text[-2000:]
assert "cannot serve a CUDA model" in text, text[-2000:]
assert "EngineCore" not in text, "an engine started before the refusal"
print("refused before start:", text.strip().splitlines()[-1])
PYEOF

step refuses-gpus-over-node 120 $PY - <<'PYEOF'
import torch
from vllm_afd.config import AFDConfig, AFDConfigError, MoEModelInfo
from vllm_afd.deployment import check_devices
gpus = torch.cuda.device_count()
info = MoEModelInfo("Qwen3MoeForCausalLM", 2, 16, 4, 2048, 256, (0, 1))
afd = AFDConfig.from_dict({"ratio": f"{gpus}:1", "transport": "deepep"})
try:
    check_devices(afd, info, gpus, "cuda", 256, torch.bfloat16)  # this node's real GPU count
except AFDConfigError as exc:
    assert f"need {gpus + 1} GPUs of their own, this node has {gpus}" in str(exc), exc
    print("refused:", exc)
else:
    raise SystemExit(f"{gpus} attention + 1 FFN rank on {gpus} GPUs was not refused")
PYEOF

step deepep-buffer 180 $PY - <<'PYEOF'
import os, sys, tempfile
import torch
try:
    import deep_ep
except ImportError as exc:
    print(f"deep_ep is not installed ({exc})")
    sys.exit(77)
import torch.distributed as dist
store = os.path.join(tempfile.mkdtemp(), "store")
dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
torch.cuda.set_device(0)
size = deep_ep.Buffer.get_low_latency_rdma_size_hint(256, 2048, 1, 16)
buffer = deep_ep.Buffer(dist.group.WORLD, num_rdma_bytes=size, low_latency_mode=True,
                        num_qps_per_rank=16)
print("low-latency buffer of", size, "bytes")
if hasattr(buffer, "destroy"):
    buffer.destroy()
dist.destroy_process_group()
PYEOF

step deepep-round-trip 240 bash -c "
$PY -c 'import deep_ep' 2>/dev/null || { echo 'deep_ep is not installed'; exit 77; }
exec $PY -m vllm_afd.testing.deepep_round_trip
"

echo "logs: $LOG_DIR"
if [ $failed -ne 0 ]; then echo "GPU SMOKE: FAIL"; exit 1; fi
echo "GPU SMOKE: PASS"
