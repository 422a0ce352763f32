"""Tools around the product: run, compare and measure deployments (none is on the data path).

``demo`` (the README's main job), ``offline_run`` (one offline generation in a child process),
``tiny_models`` (tiny MoE checkpoints built offline), ``ab`` with ``launch``/``decode``/
``window``/``metrics``/``report`` (the A/B harness, ``vllm-afd bench``), ``recipes`` (its named
configurations) and ``transport_bench`` (``python -m vllm_afd.bench.transport_bench``).
"""
