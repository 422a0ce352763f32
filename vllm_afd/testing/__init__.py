"""Test helpers that ship with the package (tests and the transport micro-benchmark use them).

``ffn``: reference FFN ranks (serve loop, process entry, echo and fault-injecting forwards).
"""
