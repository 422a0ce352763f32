"""The slot plane's Triton kernels (``slot_plane_cuda``) compiled for the GPU this project is
lent (sm_90, Triton 3.6.0: PTX, then ptxas to a cubin; no GPU needed) on every push, and the
memory semantics the protocol rests on read from the PTX: the waits' acquire loads at system
scope and their global-timer deadline, the flags' release stores at system scope after a CTA
barrier. The interpreter test runs the kernels' logic; this one what the GPU would run.

Triton comes from ``.venv/triton`` (off the venv's import path: vLLM's CPU build must not see
it), in a child process.
"""

from __future__ import annotations

import textwrap

from transport_testlib import run_with_triton

SCRIPT = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vllm_afd.transport import slot_plane_kernels as k

    i64, p64 = "i64", "*i64"
    bound = dict(error_ptr=p64, abort_ptr=p64, bound=i64, TIMED="constexpr")
    timed = {"TIMED": True}
    missed = {"MISSED": True}  # as an FFN rank's waits and answers run: a part's missed word
    # a send's three parts: the destinations' types (their addresses are the row's), sources
    parts = dict(
        t0="*bf16", s0="*bf16", n0=i64, t1="*i32", s1=p64, n1=i64, t2="*fp32", s2="*fp32", n2=i64
    )
    kernels = {
        "signal": (
            k.signal,
            dict(
                flag_ptr=p64, step_ptr=p64, offset=i64, sign=i64, missed_ptr=p64,
                MISSED="constexpr",
            ),
            missed,
        ),
        "wait": (
            k.wait,
            dict(flag_ptr=p64, step_ptr=p64, offset=i64, **bound, missed_ptr=p64,
                 MISSED="constexpr"),
            {**timed, **missed},
        ),
        "publish": (
            k.publish,
            dict(
                row=p64, **parts, step_ptr=p64, offset=i64, BLOCK="constexpr",
            ),
            {"BLOCK": 4096},
        ),
        "copy_parts": (k.copy_parts, dict(row=p64, **parts, BLOCK="constexpr"), {"BLOCK": 4096}),
        "release": (k.release, dict(row=p64, step_ptr=p64, offset=i64), {}),
        "publish_all": (
            k.publish_all,
            dict(
                table=p64, dst_type="*bf16", src_type="*bf16", missed=p64, MISSED="constexpr",
                BLOCK="constexpr",
            ),
            {**missed, "BLOCK": 4096},
        ),
        "wait_gather": (
            k.wait_gather,
            dict(
                table=p64, x="*bf16", ids="*i32", weights="*fp32", hidden=i64, top_k=i64,
                **bound, missed=p64, MISSED="constexpr", BLOCK="constexpr",
            ),
            {**timed, **missed, "BLOCK": 4096},
        ),
        "wait_sum": (
            k.wait_sum,
            dict(table=p64, count=i64, out="*bf16", n=i64, **bound, BLOCK="constexpr"),
            {**timed, "BLOCK": 4096},
        ),
    }
    out = {}
    for name, (fn, signature, constexprs) in kernels.items():
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        lines = [line.strip() for line in compiled.asm["ptx"].splitlines()]
        out[name] = {
            "cubin": len(compiled.asm["cubin"]),
            "code": [line for line in lines if line and not line.startswith("//")],
        }
    print(json.dumps(out))
    """
)


def _index(code: list[str], needle: str) -> int:
    return next(i for i, line in enumerate(code) if needle in line)


def _last(code: list[str], needle: str) -> int:
    return max(i for i, line in enumerate(code) if needle in line)


def test_the_plane_kernels_compile_for_sm90_with_the_protocols_memory_semantics(tmp_path):
    # compiled here, every time (a cache of its own), never interpreted
    env = {"TRITON_CACHE_DIR": str(tmp_path / "cache"), "TRITON_INTERPRET": ""}
    out = run_with_triton(SCRIPT, tmp_path, env)
    assert all(kernel["cubin"] > 0 for kernel in out.values())  # ptxas took the PTX
    acquire = "ld.global.sys.acquire.b64"
    for name in ("wait", "wait_gather", "wait_sum"):
        code = out[name]["code"]
        assert any(acquire in line for line in code)  # the flag, acquired
        assert any("%globaltimer" in line for line in code)  # the deadline is a time
        assert any("ld.volatile.global" in line for line in code)  # the abort word, re-read
        # a failure recorded in host memory the host reads without a sync: system scope
        assert any("atom.global.sys" in line and ".max." in line for line in code)
    for name in ("wait_gather", "wait_sum"):  # the payload is read after the flag's acquire
        code = out[name]["code"]
        assert _index(code, acquire) < _last(code, "ld.global") and "st.global" in str(code)
    release = "atom.global.sys.release.exch.b64"
    for name in ("signal", "release"):
        assert any(release in line for line in out[name]["code"])
    assert "st.global" in str(out["copy_parts"]["code"])  # copies only: ``release`` follows
    assert not any(release in line for line in out["copy_parts"]["code"])
    for name in ("publish", "publish_all"):  # the payload's stores, a barrier, then the flag
        code = out[name]["code"]
        assert _index(code, "st.global") < _index(code, "bar.sync") < _index(code, release)
    code = out["signal"]["code"]  # the step word and the missed word, then the flag
    loads = [i for i, line in enumerate(code) if "ld.global" in line]
    assert len(loads) == 2 and loads[-1] < _index(code, release)
    for name in ("wait", "wait_gather"):  # the missed word stored after the wait
        code = out[name]["code"]
        assert _last(code, acquire) < _last(code, "st.global")
