"""Model fixtures: tiny random-weight MoE checkpoints built offline (see ``vllm_afd.models.tiny``).

Nothing is imported here, so ``python -m vllm_afd.models.tiny`` runs without a runpy warning.
"""
