"""A transport backend added in one file: shm, counting its rounds (issue 18's test).

Nothing in the product names it: a run selects it by module path,
``--afd-transport tests.e2e.counting_backend:CountingShm`` (``transport.backend``), in the
front-end, the engine core and the FFN rank actors alike. Each endpoint keeps its count in
``{counts_dir}/{attention,ffn}<rank>`` (rewritten after every round), ``counts_dir`` being the
backend's own setting (``--afd-transport-config '{"counts_dir": ...}'``), so that the test
sees, from outside the product, that every combine went through this backend and that its
setting reached every endpoint.
"""

from __future__ import annotations

import os

from vllm_afd.transport.endpoint import AttentionEndpoint
from vllm_afd.transport.slots import PlaneFFN, ShmBackend


def _record(spec, side: str, rank: int, count: int) -> None:
    path = os.path.join(spec.config["counts_dir"], f"{side}{rank}")
    with open(path, "w") as f:
        f.write(str(count))


class _CountingAttention(AttentionEndpoint):
    combines = 0

    def combine(self, handle):
        out = super().combine(handle)
        self.combines += 1
        _record(self.spec, "attention", self.rank, self.combines)
        return out


class _CountingFFN(PlaneFFN):
    replies = 0

    def reply(self, request, out) -> None:
        super().reply(request, out)
        self.replies += 1
        _record(self.spec, "ffn", self.rank, self.replies)


class CountingShm(ShmBackend):
    name = "counting-shm"
    settings = {"counts_dir": str}
    attention = _CountingAttention
    ffn = _CountingFFN
