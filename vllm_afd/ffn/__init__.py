"""The FFN side of AFD, in data-path order (checkpoint to reply):

- ``weights.py``: this rank's routed experts, read from the checkpoint (``LayerExperts``).
- ``kernels.py``: the expert kernels and the routing they take (global -> local expert ids).
- ``executor.py``: ``FFNExecutor``, the serve loop (recv, experts, reply) and its stats.
"""
