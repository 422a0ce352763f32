"""The FFN side of AFD, in data-path order (checkpoint to reply):

- ``weights.py``: this rank's routed experts as the model's own vLLM MoE layers, built and
  loaded through the model's class and ``load_weights`` (``patches/ffn_rank.py`` places them).
- ``executor.py``: ``FFNExecutor``, the serve loop (recv, experts, reply) and its stats, and
  ``ExpertKernel``, each layer's own quant method given the attention side's routing.
"""
