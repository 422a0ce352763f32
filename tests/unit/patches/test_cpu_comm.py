"""S1-S2, the CPU communicator shims (wide-EP baseline): the row helpers, the expert-id
localisation, variable-size gather and reduce-scatter over two gloo processes, and install."""

from __future__ import annotations

import pytest
import torch

from vllm_afd.patches.cpu_comm import (
    localize_expert_ids,
    pack_rows,
    pad_rows,
    slice_for_rank,
    unpack_rows,
    unpad_gathered,
)


def test_pack_pad_unpad_slice_roundtrip():
    a, b = torch.randn(3, 4), torch.randint(0, 8, (3, 2), dtype=torch.int32)
    packed = pack_rows([a, b])
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4 * 4 + 2 * 4)
    x, y = unpack_rows(packed, [a, b])
    assert torch.equal(x, a) and torch.equal(y, b)
    padded = torch.cat([pad_rows(torch.ones(2, 3), 4), pad_rows(2 * torch.ones(4, 3), 4)])
    gathered = unpad_gathered(padded, [2, 4], 4)
    assert gathered.shape == (6, 3) and gathered[:2].eq(1).all() and gathered[2:].eq(2).all()
    assert torch.equal(slice_for_rank(torch.arange(6), [2, 4], 1), torch.arange(2, 6))


def test_localize_expert_ids_zeroes_foreign_experts():
    expert_map = torch.tensor([-1, -1, 0, 1])  # this rank holds global experts 2 and 3
    ids = torch.tensor([[0, 2], [3, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.4, 0.6], [0.7, 0.3]])
    local, w = localize_expert_ids(ids, weights, expert_map)
    assert local.tolist() == [[0, 0], [1, 0]] and local.dtype == torch.int32
    assert torch.allclose(w, torch.tensor([[0.0, 0.6], [0.7, 0.0]]))


class _GlooComm:
    """The attributes the shim uses, over a real gloo process group."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank_in_group, self.world_size = rank, world

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x)
        return torch.cat(parts, dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x)
        return x


def _shim_worker(rank: int, world: int, port: int, queue) -> None:
    from vllm_afd.patches import cpu_comm

    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    comm, sizes = _GlooComm(rank, world), [2, 3]
    x = torch.full((sizes[rank], 4), float(rank + 1))
    ids = torch.full((sizes[rank], 2), rank, dtype=torch.int32)
    hidden, topk = cpu_comm._all_gatherv(comm, [x, ids], 0, sizes)
    summed = cpu_comm._reduce_scatterv(comm, torch.ones(5, 4) * (rank + 1), 0, sizes)
    queue.put((rank, hidden.tolist(), topk.tolist(), summed.tolist()))
    torch.distributed.destroy_process_group()


def test_gatherv_and_reduce_scatterv_over_gloo():
    import torch.multiprocessing as tmp

    from vllm_afd.host import free_port

    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_shim_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (queue.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(30)
    for rank in range(2):
        hidden, topk, summed = results[rank]
        assert [row[0] for row in hidden] == [1.0, 1.0, 2.0, 2.0, 2.0]
        assert [row[0] for row in topk] == [0, 0, 1, 1, 1]
        assert len(summed) == [2, 3][rank] and all(v == 3.0 for row in summed for v in row)


def test_install_is_idempotent_and_patches_the_cpu_classes():
    pytest.importorskip("vllm.distributed.device_communicators.cpu_communicator")
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from vllm_afd.patches import cpu_comm

    assert cpu_comm.apply() and cpu_comm.apply()
    assert CpuCommunicator.all_gatherv is cpu_comm._all_gatherv
    assert getattr(CPUUnquantizedExperts.__init__, cpu_comm._SENTINEL)
