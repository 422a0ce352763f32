"""The slot plane's Triton kernels (``slot_plane_cuda``: a use's payload and flag published by
one kernel, the signal, the wait with its abort word) run on every push: under Triton's
interpreter (``TRITON_INTERPRET=1``) on host shared memory, in a child process, so that the
main environment keeps vLLM's CPU build without Triton.

Triton comes from ``.venv/triton`` (``make venv`` installs the GPU machine's version there, off
the venv's import path: vLLM's CPU build must not see it).
"""

from __future__ import annotations

import textwrap

from transport_testlib import run_with_triton

SCRIPT = textwrap.dedent(
    """
    import json, threading, time
    import torch
    from vllm_afd.errors import FFNRankLost, StepsFailed
    from vllm_afd.testing import slot_plane_check
    from vllm_afd.transport.slot_plane import step_word
    from vllm_afd.transport.slot_plane_cuda import TritonWaits

    if __name__ == "__main__":
        out = {}
        memory = slot_plane_check.interpreted_memory()
        kind = type(memory)
        out["kernels"] = [
            kind.signal is TritonWaits.signal,
            kind.wait is TritonWaits.wait,
            kind.publish is TritonWaits.publish and not memory.stores_on_host,
            kind.publish_all is TritonWaits.publish_all,
            kind.wait_gather is TritonWaits.wait_gather,
            kind.wait_sum is TritonWaits.wait_sum,
        ]
        # two processes, two attention ranks (the FFN rank gathers their rows and publishes
        # each share), the toy model's 4 layers x 2 microbatches x 3 steps, vLLM's DBO order;
        # the FFN process killed before step 3 and a replacement linked (its buffer takes the
        # place of the lost one in the fused kernels' tables: ``readdress``)
        out["pair"] = slot_plane_check.run_pair(
            "interpreted", torch.float32, steps=3, attention_ranks=2, replace_at=3
        )
        # a wait nobody answers, aborted by a watchdog 0.3 s in: it ends at once, check raises
        buffer, _ = memory.create(64)
        flag, step = buffer[:8].view(torch.int64), step_word(memory.device)
        step.fill_(7 << 16)
        start = time.perf_counter()
        threading.Timer(0.3, memory.abort, (FFNRankLost(0, "FFN rank 0 died"),)).start()
        memory.wait(flag, step, 0, "a flag nobody signals")
        out["aborted_after_s"] = time.perf_counter() - start
        try:
            memory.check(8)  # announcing step 8: step 7's waits stay aborted, step 8's wait
        except StepsFailed as exc:
            out["raised"] = [str(exc.cause), list(exc.steps)]
        start = time.perf_counter()
        memory.wait(flag, step, 5, "a use of step 7 the device still runs")
        out["still_aborted_after_s"] = time.perf_counter() - start
        step.fill_(8 << 16)
        # an answered use: the signal kernel's value is the use's, the wait ends clean
        memory.signal(flag, step, 2)
        memory.wait(flag, step, 2, "a signalled flag")
        memory.check()
        out["flag"] = int(flag)
        # an FFN rank's answers to two attention ranks, each into its own buffer: one kernel
        # (its table built once), every row converted to the destination's type, then each flag
        answers = [memory.create(256)[0] for _ in range(2)]
        src = torch.arange(24, dtype=torch.float32).reshape(2, 12)
        dsts = [b[128:152].view(torch.bfloat16) for b in answers]
        flags = [b[:8].view(torch.int64) for b in answers]
        other = step_word(memory.device)
        other.fill_(9 << 16)
        memory.publish_all(dsts, [src[0], src[1]], flags, [step, other], [4, 0])
        out["published"] = [dsts[0].float().tolist(), dsts[1].float().tolist()]
        out["flags"] = [int(f) for f in flags]
        out["tables"] = len(memory._tables)
        # an FFN rank takes the requests of two attention ranks (2 and 1 rows, at their own
        # steps): one kernel waits for each and lays their rows side by side
        requests = memory.create(1024)[0]
        def part(at, dtype, rows, cols):
            return requests[at : at + rows * cols * 4].view(dtype).view(rows, cols)

        src = [
            (
                part(256 * a + 128, torch.float32, 2 - a, 4),
                part(256 * a + 192, torch.int32, 2 - a, 2),
                part(256 * a + 224, torch.float32, 2 - a, 2),
            )
            for a in range(2)
        ]
        for a, (x, ids, weights) in enumerate(src):
            x.copy_(torch.arange(x.numel(), dtype=torch.float32).view_as(x) + 100 * a)
            ids.fill_(a + 1)
            weights.fill_(a / 2)
        request_flags = [requests[256 * a : 256 * a + 8].view(torch.int64) for a in range(2)]
        memory.signal(request_flags[0], step, 1)
        memory.signal(request_flags[1], other, 3)
        gathered = (torch.empty(3, 4), torch.empty(3, 2, dtype=torch.int32), torch.empty(3, 2))
        memory.wait_gather(request_flags, [step, other], [1, 3], src, gathered, lambda i: "r")
        memory.check()
        out["gathered"] = [t.tolist() for t in gathered]
        # an attention rank combines the answers of two FFN ranks: one kernel waits for both,
        # then sums them, in order and in float32, into the combine's tensor
        for f, buffer in enumerate(answers):
            buffer[128:176].view(torch.float32).copy_(torch.full((12,), 0.25 * (f + 1)))
            memory.signal(flags[f], step, 6)
        total = torch.empty(3, 4)
        views = [b[128:176].view(torch.float32).view(3, 4) for b in answers]
        memory.wait_sum(flags, [step, step], 6, views, total, lambda f: "a")
        memory.check()
        out["summed"] = total.flatten().tolist()
        # an answer that never comes: the sum's wait gives up at its bound, check raises
        memory.max_spins = 50
        memory.wait_sum(flags, [step, step], 7, views, total, lambda f: "a")
        try:
            memory.check()
        except Exception as exc:
            out["missing"] = type(exc).__name__
        out["tables_after"] = len(memory._tables)  # the fused kernels ran: one table each
        # an FFN rank's wait that gives up marks its part missed, and the answer to it is an
        # error answer (not one computed from the slot's stale rows): attention rank 1's
        # request of position 4 never comes, rank 0's of position 1 is there
        missed = torch.full((2,), 7, dtype=torch.int64)
        memory.wait_gather(
            request_flags, [step, other], [1, 4], src, gathered, lambda i: "r", missed
        )
        out["missed"] = missed.tolist()
        shares = torch.arange(24, dtype=torch.float32).reshape(2, 12)
        memory.publish_all(dsts, [shares[0], shares[1]], flags, [step, other], [10, 11], missed)
        out["missed_flags"] = [int(f) for f in flags]
        memory.wait(request_flags[0], step, 20, "a request that never comes", missed[1:])
        memory.signal(flags[1], step, 20, False, missed[1:])
        out["missed_one"] = [int(missed[1]), int(flags[1])]
        memory.wait(request_flags[0], step, 1, "a request that is there", missed[1:])
        memory.signal(flags[1], step, 1, False, missed[1:])
        out["taken_one"] = [int(missed[1]), int(flags[1])]
        try:
            memory.check()
        except Exception as exc:
            out["missed_raised"] = str(exc)
        memory.close()
        print(json.dumps(out))
    """
)


def test_the_triton_kernels_carry_the_protocol_between_two_processes(tmp_path):
    out = run_with_triton(SCRIPT, tmp_path, {"TRITON_INTERPRET": "1"})
    assert out["kernels"] == [True] * 6
    assert out["pair"] == {"max_abs_error": 0.0, "steps_checked": 3, "replaced_at": 3}
    assert out["aborted_after_s"] < 2.0  # the bound would be 40,000 polls (~10 s)
    assert out["raised"] == ["FFN rank 0 died", [7]]
    assert out["still_aborted_after_s"] < 2.0
    assert out["flag"] == (8 << 16) + 3
    assert out["published"] == [list(map(float, range(12))), list(map(float, range(12, 24)))]
    assert out["flags"] == [(8 << 16) + 5, (9 << 16) + 1] and out["tables"] == 1
    assert out["gathered"] == [
        [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [100.0, 101.0, 102.0, 103.0]],
        [[1, 1], [1, 1], [2, 2]],
        [[0.0, 0.0], [0.0, 0.0], [0.5, 0.5]],
    ]
    assert out["summed"] == [0.75] * 12
    assert out["missing"] == "FFNTimeout"
    assert out["tables_after"] == 4  # publish_all, wait_gather, wait_sum at two positions
    assert out["missed"] == [0, 1]
    assert out["missed_flags"] == [(8 << 16) + 11, -((9 << 16) + 12)]
    assert out["missed_one"] == [1, -((8 << 16) + 21)]
    assert out["taken_one"] == [0, (8 << 16) + 2]
    assert "a wait of step 9 (layer position 4)" in out["missed_raised"]  # the largest


REPLAY = textwrap.dedent(
    """
    import json
    import torch
    from vllm_afd.testing import slot_plane_check
    from vllm_afd.transport import slot_plane_cuda
    from vllm_afd.transport.slot_plane import step_word

    launches = []  # what a CUDA graph captures of a send: its kernels and their arguments


    class Recorded:
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            kernel = getattr(self.module, name)

            class Grid:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        launches.append((name, kernel, grid, args, kwargs))
                        return kernel[grid](*args, **kwargs)

                    return launch

            return Grid()


    def slot(buffer):  # a request slot: the flag, x [2, 4], ids [2, 2], weights [2, 2]
        return (
            buffer[:8].view(torch.int64),
            buffer[128:160].view(torch.float32).view(2, 4),
            buffer[256:272].view(torch.int32).view(2, 2),
            buffer[384:400].view(torch.float32).view(2, 2),
        )


    if __name__ == "__main__":
        memory = slot_plane_check.interpreted_memory()
        slot_plane_cuda._kernels = lambda module=slot_plane_cuda._kernels(): Recorded(module)
        out = {}
        for path, fused_max in (("fused", slot_plane_cuda.FUSED_MAX_BYTES), ("large", 16)):
            slot_plane_cuda.FUSED_MAX_BYTES = fused_max
            launches.clear()
            step = step_word(memory.device)
            step.fill_(3 << 16)
            x = torch.arange(8, dtype=torch.float32).view(2, 4)
            ids, weights = torch.tensor([[1, 2], [3, 4]]), torch.full((2, 2), 0.5)
            lost, replacement = memory.create(512)[0], memory.create(512)[0]
            flag, *dsts = slot(lost)
            memory.publish(dsts, (x, ids, weights), flag, step, 0)  # the run a capture records
            memory.readdress(lost, replacement)  # the lost FFN rank's replacement linked
            x.mul_(10)  # the next step's activations, in the same tensors
            step.fill_(4 << 16)
            for _, kernel, grid, args, kwargs in launches:  # the graph replayed
                kernel[grid](*args, **kwargs)
            out[path] = {
                "kernels": [name for name, *_ in launches],
                "lost": [int(flag), slot(lost)[1].flatten().tolist()],
                "replacement": [int(t) if i == 0 else t.flatten().tolist()
                                for i, t in enumerate(slot(replacement))],
            }
        memory.close()
        print(json.dumps(out))
    """
)


def test_a_replayed_send_reaches_the_replacement_of_a_lost_ffn_rank(tmp_path):
    """A CUDA graph replays a send's kernels with the arguments its capture read; once a lost
    FFN rank's replacement is linked (``PlaneMemory.readdress``), those same launches write
    the payload and the flag into the replacement's buffer and nothing into the lost one's,
    for a use in one kernel and for one too large for it (``copy_parts``, then ``release``)."""
    out = run_with_triton(REPLAY, tmp_path, {"TRITON_INTERPRET": "1"})
    assert out["fused"]["kernels"] == ["publish"]
    assert out["large"]["kernels"] == ["copy_parts", "release"]
    for path in ("fused", "large"):
        lost, replacement = out[path]["lost"], out[path]["replacement"]
        assert lost == [(3 << 16) + 1, [float(i) for i in range(8)]], path  # the first send only
        assert replacement == [
            (4 << 16) + 1,
            [10.0 * i for i in range(8)],
            [1, 2, 3, 4],
            [0.5] * 4,
        ], path
