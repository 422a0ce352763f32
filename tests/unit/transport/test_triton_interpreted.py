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
    from vllm_afd.errors import FFNRankLost
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
        ]
        # two processes, two attention ranks (the FFN rank gathers their rows and publishes
        # each share), the toy model's 4 layers x 2 microbatches x 2 steps, vLLM's DBO order
        out["pair"] = slot_plane_check.run_pair(
            "interpreted", torch.float32, steps=2, attention_ranks=2
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
            memory.check()
        except FFNRankLost as exc:
            out["raised"] = str(exc)
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
        memory.close()
        print(json.dumps(out))
    """
)


def test_the_triton_kernels_carry_the_protocol_between_two_processes(tmp_path):
    out = run_with_triton(SCRIPT, tmp_path, {"TRITON_INTERPRET": "1"})
    assert out["kernels"] == [True, True, True, True]
    assert out["pair"] == {"max_abs_error": 0.0, "steps_checked": 2}
    assert out["aborted_after_s"] < 2.0  # the bound would be 40,000 polls (~10 s)
    assert out["raised"] == "FFN rank 0 died"
    assert out["flag"] == (7 << 16) + 3
    assert out["published"] == [list(map(float, range(12))), list(map(float, range(12, 24)))]
    assert out["flags"] == [(7 << 16) + 5, (9 << 16) + 1] and out["tables"] == 1
