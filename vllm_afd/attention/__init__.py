"""The attention half of the data path: what an attention worker runs for AFD.

In the order one token meets it:

* ``session.py``: the worker's ``AttentionSession``, opened when vLLM's worker loads the model
  (patch W4): the connection to the FFN group and every piece of state that lives with it;
* ``steps.py``: when a step begins, announced to the FFN ranks once before its first dispatch,
  whichever runner or graph replay drives the forward;
* ``layer.py``: ``AFDRoutedExperts`` and its quant method, the routing boundary: the
  ``vllm_afd::remote_experts`` op;
* ``exchange.py``: one layer's round trip (dispatch, the overlap, combine);
* ``failures.py``: what happens when an FFN rank fails a layer's tokens, told once.

The FFN half is ``ffn/``; the two meet only through the transport's contract
(``transport/base.py``).
"""
