"""The slot plane's Triton kernels (``slot_plane_cuda``: what each is for, and why one kernel
per protocol operation). A module of its own so that they are module globals, as Triton's
interpreter needs of the jit functions a kernel calls, and imported only where Triton is
(``slot_plane_cuda._kernels``): vLLM's CPU build runs without it. The kernels stay
unannotated: Triton reads a kernel's parameter annotations (its argument types and
specialisation), so typing them for mypy would change the kernels.
"""

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def signal(  # type: ignore[no-untyped-def]
    flag_ptr, step_ptr, offset, sign, missed_ptr, MISSED: tl.constexpr
):
    # the use's value, negated by ``sign`` or, where MISSED, by the word in which the wait
    # for the use's request recorded that it gave up (an error answer, not one computed
    # from the slot's stale rows)
    value = (tl.load(step_ptr) + offset) * sign
    if MISSED:
        value = value * (1 - 2 * tl.load(missed_ptr))
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit  # type: ignore[untyped-decorator]
def await_flag(  # type: ignore[no-untyped-def]
    flag, want, abort_ptr, bound, start, TIMED: tl.constexpr
):
    # spin on an acquire load at system scope until ``|flag|`` reaches ``want``, the abort
    # word reaches it (``RecordedWaits.aborted``) or the bound passed (TIMED: nanoseconds of
    # the global timer since ``start``; else polls); true where it ended on another value
    # than ``want``
    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    aborted = tl.load(abort_ptr, volatile=True)
    spins = 0
    within = spins < bound
    while (seen < want) & (seen > -want) & within & (aborted < want):
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        aborted = tl.load(abort_ptr, volatile=True)
        spins += 1
        if TIMED:
            within = tl.extra.cuda.globaltimer() - start < bound
        else:
            within = spins < bound
    return seen != want


@triton.jit  # type: ignore[untyped-decorator]
def await_row(  # type: ignore[no-untyped-def]
    row, error_ptr, abort_ptr, bound, start, record, TIMED: tl.constexpr
):
    # ``await_flag`` of a fused kernel's table row (int64 words: the flag's address, its
    # sender's step word's address, the use's offset); a failed wait's value recorded in
    # ``error_ptr`` (host memory the host reads without a sync: system scope) where
    # ``record``; true where it failed
    flag = tl.load(row).to(tl.pointer_type(tl.int64))
    want = tl.load(tl.load(row + 1).to(tl.pointer_type(tl.int64))) + tl.load(row + 2)
    failed = await_flag(flag, want, abort_ptr, bound, start, TIMED)
    if failed & record:
        tl.atomic_max(error_ptr, want, scope="sys")
    return failed


@triton.jit  # type: ignore[untyped-decorator]
def copy_rows(  # type: ignore[no-untyped-def]
    dst, src, n, BLOCK: tl.constexpr
):
    # ``n`` elements of ``src`` (an int64 address, of ``dst``'s element type) to ``dst``
    src = src.to(dst.dtype)
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        tl.store(dst + at, tl.load(src + at, mask=at < n), mask=at < n)


@triton.jit  # type: ignore[untyped-decorator]
def clock(TIMED: tl.constexpr):  # type: ignore[no-untyped-def]
    if TIMED:
        return tl.extra.cuda.globaltimer()
    else:
        return 0


@triton.jit  # type: ignore[untyped-decorator]
def wait(  # type: ignore[no-untyped-def]
    flag_ptr,
    step_ptr,
    offset,
    error_ptr,
    abort_ptr,
    bound,
    missed_ptr,
    TIMED: tl.constexpr,
    MISSED: tl.constexpr,
):
    # one flag, awaited at the use's value; bound: nanoseconds of the GPU's global timer
    # (TIMED), else polls (the interpreter, which has no device clock); where MISSED, 1 into
    # ``missed_ptr`` if it gave up, else 0 (what the answer's ``signal`` reads)
    want = tl.load(step_ptr) + offset
    failed = await_flag(flag_ptr, want, abort_ptr, bound, clock(TIMED), TIMED)
    if failed:
        tl.atomic_max(error_ptr, want, scope="sys")
    if MISSED:
        tl.store(missed_ptr, failed.to(tl.int64))


@triton.jit  # type: ignore[untyped-decorator]
def copy_part(  # type: ignore[no-untyped-def]
    dst, src, n, first, stride, BLOCK: tl.constexpr
):
    # blocks ``first``, ``first + stride``, ... of the ``n`` elements of ``src`` into ``dst``,
    # converted to ``dst``'s element type
    for start in range(first * BLOCK, n, stride * BLOCK):
        at = start + tl.arange(0, BLOCK)
        part = tl.load(src + at, mask=at < n).to(dst.dtype.element_ty)
        tl.store(dst + at, part, mask=at < n)


@triton.jit  # type: ignore[untyped-decorator]
def publish(  # type: ignore[no-untyped-def]
    row, t0, s0, n0, t1, s1, n1, t2, s2, n2, step_ptr, offset, BLOCK: tl.constexpr
):
    # one program: every element of up to three parts into the peer's slot, converted to
    # the destination's type (vLLM's int64 expert ids to the slot's int32), the CTA's
    # stores ordered before the flag (barrier, then a release store at system scope). The
    # destinations and the flag are ``row``'s int64 words (addresses in the peer's buffer,
    # rewritten when a replacement's buffer takes its place: a CUDA graph replays ``row``);
    # ``t0``-``t2`` give only their element types
    copy_part(tl.load(row).to(t0.dtype), s0, n0, 0, 1, BLOCK)
    copy_part(tl.load(row + 1).to(t1.dtype), s1, n1, 0, 1, BLOCK)
    copy_part(tl.load(row + 2).to(t2.dtype), s2, n2, 0, 1, BLOCK)
    tl.debug_barrier()
    value = tl.load(step_ptr) + offset
    tl.atomic_xchg(
        tl.load(row + 3).to(tl.pointer_type(tl.int64)), value, sem="release", scope="sys"
    )


@triton.jit  # type: ignore[untyped-decorator]
def copy_parts(  # type: ignore[no-untyped-def]
    row, t0, s0, n0, t1, s1, n1, t2, s2, n2, BLOCK: tl.constexpr
):
    # ``publish``'s copies by every program (a use too large for one: a prefill chunk, a
    # large decode batch), each its share of the blocks; ``release`` stores the flag after
    copy_part(tl.load(row).to(t0.dtype), s0, n0, tl.program_id(0), tl.num_programs(0), BLOCK)
    copy_part(tl.load(row + 1).to(t1.dtype), s1, n1, tl.program_id(0), tl.num_programs(0), BLOCK)
    copy_part(tl.load(row + 2).to(t2.dtype), s2, n2, tl.program_id(0), tl.num_programs(0), BLOCK)


@triton.jit
def release(row, step_ptr, offset):  # type: ignore[no-untyped-def]
    # the flag of ``row`` (its word 3), after ``copy_parts`` in stream order: a release store
    # at system scope of the use's value
    value = tl.load(step_ptr) + offset
    tl.atomic_xchg(
        tl.load(row + 3).to(tl.pointer_type(tl.int64)), value, sem="release", scope="sys"
    )


@triton.jit  # type: ignore[untyped-decorator]
def publish_all(  # type: ignore[no-untyped-def]
    table, dst_type, src_type, missed, MISSED: tl.constexpr, BLOCK: tl.constexpr
):
    # program i publishes part i, its row of ``table`` (int64 words: destination, source,
    # elements, flag, step word, offset; addresses, since each destination is another
    # attention rank's buffer): the copy, the CTA's barrier, the flag's release store, its
    # value negated where MISSED and ``missed[i]`` is 1 (the wait for part i's request gave
    # up: an error answer); ``dst_type``, ``src_type``: the first part's tensors, for the
    # element types
    row = table + tl.program_id(0) * 6
    dst = tl.load(row).to(dst_type.dtype)
    src = tl.load(row + 1).to(src_type.dtype)
    n = tl.load(row + 2)
    flag = tl.load(row + 3).to(tl.pointer_type(tl.int64))
    step = tl.load(row + 4).to(tl.pointer_type(tl.int64))
    for start in range(0, n, BLOCK):
        at = start + tl.arange(0, BLOCK)
        part = tl.load(src + at, mask=at < n).to(dst_type.dtype.element_ty)
        tl.store(dst + at, part, mask=at < n)
    tl.debug_barrier()
    value = tl.load(step) + tl.load(row + 5)
    if MISSED:
        value = value * (1 - 2 * tl.load(missed + tl.program_id(0)))
    tl.atomic_xchg(flag, value, sem="release", scope="sys")


@triton.jit  # type: ignore[untyped-decorator]
def wait_gather(  # type: ignore[no-untyped-def]
    table,
    x,
    ids,
    weights,
    hidden,
    top_k,
    error_ptr,
    abort_ptr,
    bound,
    missed,
    TIMED: tl.constexpr,
    MISSED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # program i takes sender i's request, its row of ``table`` (int64 words: flag, step
    # word, offset, then the request's x, ids and weights, its first gathered row, its
    # rows): the wait (where MISSED, 1 into ``missed[i]`` if it gave up, else 0), then its
    # rows copied into rows [first, first + rows) of ``x`` ``[R, hidden]``, ``ids`` and
    # ``weights`` ``[R, top_k]`` (the senders' slots lie in one buffer but a slot apart: the
    # forward needs them side by side)
    row = table + tl.program_id(0) * 8
    failed = await_row(row, error_ptr, abort_ptr, bound, clock(TIMED), True, TIMED)
    if MISSED:
        tl.store(missed + tl.program_id(0), failed.to(tl.int64))
    first, rows = tl.load(row + 6), tl.load(row + 7)
    copy_rows(x + first * hidden, tl.load(row + 3), rows * hidden, BLOCK)
    copy_rows(ids + first * top_k, tl.load(row + 4), rows * top_k, BLOCK)
    copy_rows(weights + first * top_k, tl.load(row + 5), rows * top_k, BLOCK)


@triton.jit  # type: ignore[untyped-decorator]
def wait_sum(  # type: ignore[no-untyped-def]
    table,
    count,
    out,
    n,
    error_ptr,
    abort_ptr,
    bound,
    TIMED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # every program waits for the ``count`` answers, rows of ``table`` (int64 words:
    # flag, step word, offset, answer), program 0 counting a failed wait; then sums its
    # blocks of the ``n`` elements of every answer, in order and in float32, into ``out``
    start = clock(TIMED)
    for i in range(count):
        await_row(table + i * 4, error_ptr, abort_ptr, bound, start, tl.program_id(0) == 0, TIMED)
    for begin in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        at = begin + tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(count):
            answer = tl.load(table + i * 4 + 3).to(out.dtype)
            acc += tl.load(answer + at, mask=at < n).to(tl.float32)
        tl.store(out + at, acc.to(out.dtype.element_ty), mask=at < n)
