"""Micro-benchmarks (``python -m vllm_afd.bench.<name>``)."""
