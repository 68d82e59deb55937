"""Float32 matmul a [M, K] @ w [K, N]: the linears `qwc optimize --keep-float` leaves in float.

TVM's generic rule ran each output as a scalar dot product down a column of w, N floats apart
each step (a float SmolLM2 decoded 10 tokens/s; llama.cpp's F32 build 47). Here w is stored in
blocks of `cols` columns, each block's K rows contiguous (compiler/repack.py:
float_column_blocks), and a parallel task owns one block: it walks K once per tile of `rows`
rows of a, each step a few vector loads of w feeding every row of the tile, the sums held in
registers. A block's tiles run back to back on one thread, so its slice of w comes from memory
once and then from L2; contiguous, it costs no TLB miss a row as a column walk did.
"""

from __future__ import annotations

import functools

from tvm import tirx

from . import hand_scheduled

MAX_ROWS = 8         # a tile's rows (unrolled): each load of w feeds up to 8 rows
MIN_GROUPS = 16      # column blocks to share among the threads: narrower blocks below this
STACK_BYTES = 1024   # TVM puts an allocation on the stack (LLVM's registers) only below this
# A tile of several rows spends longer on each row of w than a decode GEMV does, and reads
# faster prefetching this far ahead in its block (bench/f32_matmul.py); a GEMV gains nothing.
PREFETCH_BYTES = 4096


def columns(n: int, registers: tuple[int, int]) -> int | None:
    """The columns of a block on a file of registers = (count, bytes): four vectors, fewer
    where N has under MIN_GROUPS blocks of them; None where N is no multiple of a vector."""
    lanes = registers[1] // 4
    cols = 4 * lanes
    while cols > lanes and (n % cols or n // cols < MIN_GROUPS):
        cols //= 2
    return None if n % cols else cols


def tile_rows(cols: int, registers: tuple[int, int], one_token: bool) -> int:
    """A tile's rows: as many as keep its sums in half the register file (the other half holds
    w's loads and a's broadcasts) and under STACK_BYTES (a bigger buffer of sums lives in
    memory: a store after every FMA). A decode call has one."""
    count, width = registers
    if one_token:
        return 1
    return max(1, min(MAX_ROWS, count // 2 // max(1, cols // (width // 4)), (STACK_BYTES - 1) // (4 * cols)))


def pack(w, cols: int):
    """w [K, N] -> [N / cols, K, cols]: each block of columns contiguous, as a task reads it."""
    k, n = w.shape
    return w.reshape(k, n // cols, cols).transpose(1, 0, 2).copy()


@functools.lru_cache(maxsize=None)   # parsing the script is ~0.1 s; a model has 7 linears a layer
def kernel(k: int, n: int, cols: int, one_token: bool, registers: tuple[int, int]) -> tirx.PrimFunc:
    """(a [M, K], w [N / cols, K, cols]) -> y [M, N]; M = 1 when `one_token`, else any.
    Column block g is one parallel task, which runs every tile of rows over it: M // rows full
    tiles, then the rest in tiles of the rest's binary digits (4, 2, 1), as vnni.py's tiles."""
    from tvm.script import tirx as T

    rows = tile_rows(cols, registers, one_token)
    lanes = registers[1] // 4
    if cols % lanes or n % cols:
        raise ValueError(f"float matmul {n}x{k}: blocks of {cols} columns on {lanes}-float vectors")
    vecs, groups = cols // lanes, n // cols
    ahead = PREFETCH_BYTES // (4 * cols)   # rows

    @T.macro
    def block(a, w, y, g, first, count):
        """Rows first .. first+count-1 of columns g*cols .. g*cols+cols-1."""
        # "global", not "local": a small constant-size global allocation goes on the stack
        # (LLVM keeps it in registers); a "local" one is a TVMBackendAllocWorkspace call.
        acc = T.decl_buffer((count * cols,), "float32", scope="global")
        for i in T.unroll(count * vecs):
            acc[T.ramp(i * lanes, 1, lanes)] = T.broadcast(T.float32(0), lanes)
        for r in range(k):
            if not one_token:   # decided when the kernel is built
                for c in T.unroll(max(1, cols // 16)):   # its 64-byte lines (past the end: a no-op)
                    T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(w[g, r + ahead, c * 16]),
                                                  T.int32(0), T.int32(3), T.int32(1)))
            for i in T.unroll(count):
                for v in T.unroll(vecs):
                    acc[T.ramp((i * vecs + v) * lanes, 1, lanes)] = acc[T.ramp((i * vecs + v) * lanes, 1, lanes)] + (
                        T.broadcast(a[first + i, r], lanes) * w[g, r, T.ramp(v * lanes, 1, lanes)])
        for i in T.unroll(count):
            for v in T.unroll(vecs):
                y[first + i, T.ramp(g * cols + v * lanes, 1, lanes)] = acc[T.ramp((i * vecs + v) * lanes, 1, lanes)]

    if one_token:
        @T.prim_func(private=True)
        def f32_matmul(a: T.Buffer((1, k), "float32"), w: T.Buffer((groups, k, cols), "float32"),
                       y: T.Buffer((1, n), "float32")):
            for g in T.parallel(groups):
                block(a, w, y, g, 0, 1)
    else:
        @T.prim_func(private=True)
        def f32_matmul(a_h: T.handle, w: T.Buffer((groups, k, cols), "float32"), y_h: T.handle):
            m = T.int64()
            a = T.match_buffer(a_h, (m, k), "float32")
            y = T.match_buffer(y_h, (m, n), "float32")
            for g in T.parallel(groups):
                for t in range(m // rows):
                    block(a, w, y, g, t * rows, rows)
                if rows > 4:   # decided when the kernel is built
                    if m % rows // 4 % 2 == 1:
                        block(a, w, y, g, m // rows * rows, 4)
                if rows > 2:
                    if m % rows // 2 % 2 == 1:
                        block(a, w, y, g, m // rows * rows + m % rows // 4 * 4, 2)
                if rows > 1:
                    if m % rows % 2 == 1:
                        block(a, w, y, g, m - 1, 1)

    return hand_scheduled(f32_matmul).with_attr("op_pattern", 8)
