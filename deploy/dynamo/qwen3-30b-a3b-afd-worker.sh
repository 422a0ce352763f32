#!/usr/bin/env bash
# A Dynamo vLLM worker serving Qwen3-30B-A3B with AFD 7:1 on one node of 8 GPUs. Dynamo builds
# vLLM's engine from vLLM's own engine arguments, so AFD goes in through --additional-config
# (the long form of every --afd-* flag; docs/user-guide.md) and the plugin loads as in any vLLM
# process (its `vllm.general_plugins` entry point). The data-parallel size is given: the
# one-flag form (`--afd-ratio 7:1` alone) is `vllm serve`'s.
#
# NOT YET RUN under Dynamo or on a GPU: tests/unit/test_manifests.py runs the vLLM arguments
# below through vLLM's parser and the product's start-up checks for an 8-GPU node.
set -euo pipefail
exec python -m dynamo.vllm \
    --model Qwen/Qwen3-30B-A3B \
    --data-parallel-size 7 \
    --additional-config '{"afd": {"ratio": "7:1", "transport": "slots"}}'
