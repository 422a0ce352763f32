#!/usr/bin/env bash
# GPU smoke test of vllm-afd: one script, every step under its own timeout, one PASS/FAIL/SKIP
# line per step, a summary at the end; exit status 1 if any step failed. Meant for a machine
# with NVIDIA GPUs and vLLM's GPU build (vllm==0.33.x) in the active environment (or
# PYTHON=/path/to/python); runs in well under 8 minutes on one node.
#
# What it covers (docs/architecture.md, "The GPU path"): the plugin loads and its patch ledger
# accepts the GPU build's vLLM; the platform is seen as CUDA and the start-up refusals fire
# there (shm/nixl with a CUDA model, A + F over the node's GPUs); the slot plane's own device
# check (PyTorch and Triton only: python -m vllm_afd.testing.slot_plane_check); with two GPUs
# or more, the offline LLM API served with AFD 1:1 on the slots transport next to colocated
# serving (tokens compared; bf16 may differ late in a sequence). NOT YET RUN: no GPU with
# vLLM's GPU build was lent to the sessions that wrote it.
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
from vllm_afd.config import AFDConfig
from vllm_afd.errors import AFDConfigError
from vllm_afd.deployment import check_devices
gpus = torch.cuda.device_count()
afd = AFDConfig.from_dict({"ratio": f"{gpus}:1", "transport": "slots", "ffn_device": "cuda"})
try:
    check_devices(afd, gpus, "cuda")  # this node's real GPU count
except AFDConfigError as exc:
    assert f"need {gpus + 1} GPUs of their own, this node has {gpus}" in str(exc), exc
    print("refused:", exc)
else:
    raise SystemExit(f"{gpus} attention + 1 FFN rank on {gpus} GPUs was not refused")
PYEOF

step slot-plane-check 320 $PY -m vllm_afd.testing.slot_plane_check --json "$LOG_DIR/slot_plane.json"

step serve-slots-1to1 420 $PY - "$MODEL_DIR" <<'PYEOF'
import sys
import torch
from vllm_afd.bench.offline_run import run_generation
if torch.cuda.device_count() < 2:
    print("AFD 1:1 on GPUs needs 2 GPUs (one attention, one FFN rank)")
    sys.exit(77)
job = {"model": sys.argv[1], "prompts": ["hello world", "1 2 3 4"], "max_tokens": 16}
colocated = run_generation(job)
afd = run_generation(job | {"afd": {"ratio": "1:1", "transport": "slots"}})
same = sum(a == c for a, c in zip(afd["token_ids"], colocated["token_ids"]))
print(f"AFD 1:1 (slots) served; {same} of {len(job['prompts'])} sequences equal colocated's")
assert afd["ffn"] and afd["ffn"][0]["tokens"] > 0, afd["ffn"]
PYEOF

echo "logs: $LOG_DIR"
if [ $failed -ne 0 ]; then echo "GPU SMOKE: FAIL"; exit 1; fi
echo "GPU SMOKE: PASS"
