"""LoRA adapters served beside the quantized linears: y + s·B·(A·x), one adapter per token.

An artifact compiled with `--max-lora-rank` holds adapter slots (compiler/lora_slots.py): for
each adapted linear, A of every slot [S, K, C, 16] and B [S, C, 16, N], the rank padded with
zeros to C chunks of 16, and each token's slot [M] (0: the base, no adapter). The two kernels
are Punica's "shrink" and "expand" for a batch whose tokens each gather their own adapter, so
one call runs a batch that mixes adapters and the base:

    shrink:      t[m] = A[slot[m]] · x[m]           [M, C, 16]
    expand_add:  y[m] += B[slot[m]] · t[m]          [M, N], in place

Tokens are taken TILE at a time where they share an adapter (a prompt, a step's segment), so a
load of A or B feeds several of them; a batched decode step's rows, each its own, go one by one.

S and C are symbolic: the runtime sizes the slots by the adapters it loads and the largest
rank among them. Both loops keep the contiguous 16 ranks (shrink) or output columns (expand)
in vectors, so neither needs a horizontal sum; a base token skips both, and its row of y is
not touched. A call whose tokens are all the base's returns at once (no parallel launch: a
server's steps without adapters pay a function call a kernel), and one with little work (a
decode step's token at a small rank, a batched step's few) runs on the calling thread, where a
parallel launch would cost more than the work. The scale s is folded into B when the runtime writes a slot
(runtime/adapters.py).
"""

from __future__ import annotations

import functools

from tvm import tirx

from . import hand_scheduled

CHUNK = 16          # ranks a vector holds: the padded rank is a multiple of it
# Independent sums over K a token (the FMA latency), added at the end. A tile's tokens and a
# lone token sum alike, so a token's result does not depend on which tokens share its call.
SHRINK_SPLIT = 2
EXPAND_COLS = 64    # output columns a parallel task of expand_add owns (16 where N is not a multiple)
# Tokens a task takes together where they share an adapter (a prompt's, a step's segment): each
# load of A or B feeds all of them. Its sums stay under 1 KiB, which TVM keeps on the stack.
TILE = 4
# Below this many multiply-adds a call runs on the calling thread: a parallel launch costs about
# what this much work does (a batched decode step's few rows).
SERIAL_WORK = 1 << 18


def expand_cols(n: int) -> int:
    if n % CHUNK:
        raise ValueError(f"LoRA slots need linears whose outputs are a multiple of {CHUNK} (got {n})")
    return EXPAND_COLS if n % EXPAND_COLS == 0 else CHUNK


@functools.lru_cache(maxsize=None)
def shrink(k: int, prologue: str = "plain", eps: float = 0.0) -> tirx.PrimFunc:
    """(x [M, K], slot [M] int64, a [S, K, C, 16]) -> t [M, C, 16]; a task per (tile of TILE
    tokens, chunk). The prologue is what the linear's quantizer computes itself
    (kernels/act_quant.py), so its float input is never materialised, and a base token computes
    none of it: "silu_mul": x is (gate, up) and the product reads silu(gate)·up (the down
    projection); "rms": x is (h, gamma) and it reads RMSNorm(h)·gamma with `eps` (q/k/v, gate/up)."""
    from tvm.script import tirx as T

    from . import vector_math

    if k % CHUNK:
        raise ValueError(f"LoRA shrink over K = {k}: not a multiple of {CHUNK}")
    if prologue not in ("plain", "silu_mul", "rms"):
        raise ValueError(f"LoRA shrink prologue {prologue!r}")
    blocks = k // CHUNK

    def rows_body(nr: int):
        """Rows r0 .. r0 + nr - 1, all of adapter `which`: each load of A feeds nr rows, each
        row's SHRINK_SPLIT sums in the same order whatever nr is."""
        chains = nr * SHRINK_SPLIT

        @T.macro
        def body(x, u, a, t, which, r0, ch):
            acc = T.decl_buffer((chains * CHUNK,), "float32", scope="global")
            xs = T.decl_buffer((nr * CHUNK,), "float32", scope="global")
            inv = T.decl_buffer((nr,), "float32", scope="global")
            for j in T.unroll(chains):
                acc[T.ramp(j * CHUNK, 1, CHUNK)] = T.broadcast(T.float32(0), CHUNK)
            if prologue == "rms":   # decided when the kernel is built: each row's 1 / rms first
                for i in T.unroll(nr):
                    xs[T.ramp(i * CHUNK, 1, CHUNK)] = T.broadcast(T.float32(0), CHUNK)
                    for kb in range(blocks):
                        xs[T.ramp(i * CHUNK, 1, CHUNK)] = xs[T.ramp(i * CHUNK, 1, CHUNK)] + (
                            x[r0 + i, T.ramp(kb * CHUNK, 1, CHUNK)] * x[r0 + i, T.ramp(kb * CHUNK, 1, CHUNK)])
                    inv[i] = T.float32(1) / T.sqrt(vector_math.reduce_sum(T, xs[T.ramp(i * CHUNK, 1, CHUNK)], CHUNK)
                                                    / T.float32(k) + T.float32(eps))
            for kb in range(blocks):
                for i in T.unroll(nr):
                    if prologue == "silu_mul":
                        xs[T.ramp(i * CHUNK, 1, CHUNK)] = vector_math.silu(
                            T, x[r0 + i, T.ramp(kb * CHUNK, 1, CHUNK)], CHUNK) * u[r0 + i, T.ramp(kb * CHUNK, 1, CHUNK)]
                    elif prologue == "rms":
                        xs[T.ramp(i * CHUNK, 1, CHUNK)] = x[r0 + i, T.ramp(kb * CHUNK, 1, CHUNK)] * (
                            T.broadcast(inv[i], CHUNK) * u[T.ramp(kb * CHUNK, 1, CHUNK)])
                    else:
                        xs[T.ramp(i * CHUNK, 1, CHUNK)] = x[r0 + i, T.ramp(kb * CHUNK, 1, CHUNK)]
                for j in T.unroll(CHUNK):
                    for i in T.unroll(nr):
                        acc[T.ramp((i * SHRINK_SPLIT + j % SHRINK_SPLIT) * CHUNK, 1, CHUNK)] = (
                            acc[T.ramp((i * SHRINK_SPLIT + j % SHRINK_SPLIT) * CHUNK, 1, CHUNK)]
                            + T.broadcast(xs[i * CHUNK + j], CHUNK) * a[which, kb * CHUNK + j, ch, T.ramp(0, 1, CHUNK)])
            for i in T.unroll(nr):
                for j in T.unroll(SHRINK_SPLIT - 1):
                    acc[T.ramp(i * SHRINK_SPLIT * CHUNK, 1, CHUNK)] = acc[T.ramp(i * SHRINK_SPLIT * CHUNK, 1, CHUNK)] + (
                        acc[T.ramp((i * SHRINK_SPLIT + j + 1) * CHUNK, 1, CHUNK)])
                t[r0 + i, ch, T.ramp(0, 1, CHUNK)] = acc[T.ramp(i * SHRINK_SPLIT * CHUNK, 1, CHUNK)]
        return body

    tile, one = rows_body(TILE), rows_body(1)
    adapted, same = _adapted(T), _same_slot(T)

    @T.macro
    def task_body(x, u, slot, a, t, s, c, m, task):
        r0 = task // c * TILE
        ch = task % c
        which = slot[r0]
        flag = T.decl_buffer((1,), "int32", scope="global")
        same(slot, m, r0, flag)
        if flag[0] > 0 and which > 0 and which < s:
            tile(x, u, a, t, which, r0, ch)
        else:   # a part tile, or tokens of several adapters; a base token's row of t is not read
            for i in range(TILE):
                if r0 + i < m:
                    if slot[r0 + i] > 0 and slot[r0 + i] < s:
                        one(x, u, a, t, slot[r0 + i], r0 + i, ch)

    @T.macro
    def run(x, u, slot, a, t, s, c, m):
        used = T.decl_buffer((1,), "int32", scope="global")
        adapted(slot, m, used)
        if used[0] > 0:   # all the base's: nothing to do (the expand reads no base token's row)
            if m * c * CHUNK * k <= SERIAL_WORK:
                for task in range((m + TILE - 1) // TILE * c):
                    task_body(x, u, slot, a, t, s, c, m, task)
            else:
                for task in T.parallel((m + TILE - 1) // TILE * c):
                    task_body(x, u, slot, a, t, s, c, m, task)

    if prologue == "silu_mul":
        @T.prim_func(private=True)
        def lora_shrink(g_h: T.handle, u_h: T.handle, slot_h: T.handle, a_h: T.handle, t_h: T.handle):
            m, s, c = T.int64(), T.int64(), T.int64()
            g = T.match_buffer(g_h, (m, k), "float32")
            u = T.match_buffer(u_h, (m, k), "float32")
            slot = T.match_buffer(slot_h, (m,), "int64")
            a = T.match_buffer(a_h, (s, k, c, CHUNK), "float32")
            t = T.match_buffer(t_h, (m, c, CHUNK), "float32")
            run(g, u, slot, a, t, s, c, m)
    elif prologue == "rms":
        @T.prim_func(private=True)
        def lora_shrink(h_h: T.handle, gamma: T.Buffer((k,), "float32"), slot_h: T.handle, a_h: T.handle,
                        t_h: T.handle):
            m, s, c = T.int64(), T.int64(), T.int64()
            h = T.match_buffer(h_h, (m, k), "float32")
            slot = T.match_buffer(slot_h, (m,), "int64")
            a = T.match_buffer(a_h, (s, k, c, CHUNK), "float32")
            t = T.match_buffer(t_h, (m, c, CHUNK), "float32")
            run(h, gamma, slot, a, t, s, c, m)
    else:
        @T.prim_func(private=True)
        def lora_shrink(x_h: T.handle, slot_h: T.handle, a_h: T.handle, t_h: T.handle):
            m, s, c = T.int64(), T.int64(), T.int64()
            x = T.match_buffer(x_h, (m, k), "float32")
            slot = T.match_buffer(slot_h, (m,), "int64")
            a = T.match_buffer(a_h, (s, k, c, CHUNK), "float32")
            t = T.match_buffer(t_h, (m, c, CHUNK), "float32")
            run(x, x, slot, a, t, s, c, m)

    return hand_scheduled(lora_shrink)


@functools.lru_cache(maxsize=None)
def expand_add(n: int) -> tirx.PrimFunc:
    """(y [M, N], t [M, C, 16], slot [M] int64, b [S, C, 16, N]): y += b[slot]·t in place (a
    call_tir_inplace on y); a task per (tile of TILE tokens, block of columns)."""
    from tvm.script import tirx as T

    cols = expand_cols(n)
    vecs, groups = cols // CHUNK, n // cols

    def rows_body(nr: int):
        """Rows r0 .. r0 + nr - 1 of adapter `which`: each load of B feeds nr rows. The sums
        are two buffers of half the rows each: one of 1 KiB would not stay on the stack."""
        half = (nr + 1) // 2

        @T.macro
        def body(y, t, b, which, r0, g, c):
            lo = T.decl_buffer((half * cols,), "float32", scope="global")
            hi = T.decl_buffer((half * cols,), "float32", scope="global")
            for i in T.unroll(nr):
                for v in T.unroll(vecs):
                    if i < half:
                        lo[T.ramp((i * vecs + v) * CHUNK, 1, CHUNK)] = y[r0 + i, T.ramp(g * cols + v * CHUNK, 1, CHUNK)]
                    else:
                        hi[T.ramp(((i - half) * vecs + v) * CHUNK, 1, CHUNK)] = y[r0 + i, T.ramp(g * cols + v * CHUNK, 1, CHUNK)]
            for ch in range(c):
                for j in T.unroll(CHUNK):
                    for v in T.unroll(vecs):
                        for i in T.unroll(nr):
                            if i < half:
                                lo[T.ramp((i * vecs + v) * CHUNK, 1, CHUNK)] = lo[T.ramp((i * vecs + v) * CHUNK, 1, CHUNK)] + (
                                    T.broadcast(t[r0 + i, ch, j], CHUNK) * b[which, ch, j, T.ramp(g * cols + v * CHUNK, 1, CHUNK)])
                            else:
                                hi[T.ramp(((i - half) * vecs + v) * CHUNK, 1, CHUNK)] = (
                                    hi[T.ramp(((i - half) * vecs + v) * CHUNK, 1, CHUNK)]
                                    + T.broadcast(t[r0 + i, ch, j], CHUNK) * b[which, ch, j, T.ramp(g * cols + v * CHUNK, 1, CHUNK)])
            for i in T.unroll(nr):
                for v in T.unroll(vecs):
                    if i < half:
                        y[r0 + i, T.ramp(g * cols + v * CHUNK, 1, CHUNK)] = lo[T.ramp((i * vecs + v) * CHUNK, 1, CHUNK)]
                    else:
                        y[r0 + i, T.ramp(g * cols + v * CHUNK, 1, CHUNK)] = hi[T.ramp(((i - half) * vecs + v) * CHUNK, 1, CHUNK)]
        return body

    tile, one = rows_body(TILE), rows_body(1)
    adapted, same = _adapted(T), _same_slot(T)

    @T.macro
    def task_body(y, t, slot, b, s, c, m, task):
        r0 = task // groups * TILE
        g = task % groups
        which = slot[r0]
        flag = T.decl_buffer((1,), "int32", scope="global")
        same(slot, m, r0, flag)
        if flag[0] > 0 and which > 0 and which < s:
            tile(y, t, b, which, r0, g, c)
        else:
            for i in range(TILE):
                if r0 + i < m:
                    if slot[r0 + i] > 0 and slot[r0 + i] < s:
                        one(y, t, b, slot[r0 + i], r0 + i, g, c)

    @T.prim_func(private=True)
    def lora_expand_add(y_h: T.handle, t_h: T.handle, slot_h: T.handle, b_h: T.handle):
        m, s, c = T.int64(), T.int64(), T.int64()
        y = T.match_buffer(y_h, (m, n), "float32")
        t = T.match_buffer(t_h, (m, c, CHUNK), "float32")
        slot = T.match_buffer(slot_h, (m,), "int64")
        b = T.match_buffer(b_h, (s, c, CHUNK, n), "float32")
        used = T.decl_buffer((1,), "int32", scope="global")
        adapted(slot, m, used)
        if used[0] > 0:
            if m * c * CHUNK * n <= SERIAL_WORK:
                for task in range((m + TILE - 1) // TILE * groups):
                    task_body(y, t, slot, b, s, c, m, task)
            else:
                for task in T.parallel((m + TILE - 1) // TILE * groups):
                    task_body(y, t, slot, b, s, c, m, task)

    return hand_scheduled(lora_expand_add)


def _same_slot(T):
    """A macro: flag[0] = 1 where tokens r0 .. r0 + TILE - 1 all exist and share one slot."""
    @T.macro
    def same(slot, m, r0, flag):
        flag[0] = 1
        for i in range(TILE):
            if r0 + i >= m:
                flag[0] = 0
            elif slot[r0 + i] != slot[r0]:
                flag[0] = 0
    return same


def _adapted(T):
    """A macro: used[0] = 1 where any token of the call has an adapter, else 0."""
    @T.macro
    def adapted(slot, m, used):
        used[0] = 0
        for i in range(m):
            if slot[i] > 0:
                used[0] = 1
    return adapted
