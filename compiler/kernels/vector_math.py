"""Elementwise math for qwc's hand TIR kernels that stays in vector registers.

LLVM scalarises a vector `llvm.exp` into one libm `expf` call per lane (and TVM emits a call
for a scalar `T.exp` too); the kernels that take an exp per element (SiLU before the
activation quantizer, the attention softmax) use these instead.
"""

from __future__ import annotations


def const(T, v, lanes: int):
    """A float32 constant of `lanes` lanes (a scalar for 1)."""
    return T.broadcast(T.float32(v), lanes) if lanes > 1 else T.float32(v)


def exp(T, x, lanes: int):
    """exp(x) for float32 x with `lanes` lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the
    degree-6 Taylor polynomial (relative error < 2e-7). x is clamped to [-87, 88]: below, the
    result is ~1e-38, not 0."""
    def c(v):
        return const(T, v, lanes)

    ity = f"int32x{lanes}" if lanes > 1 else "int32"
    x = T.max(T.min(x, c(88.0)), c(-87.0))
    n = T.floor(x * c(1.4426950408889634) + c(0.5))
    r = x - n * c(0.693359375) - n * c(-2.12194440e-4)   # ln 2 in two parts: n * 0.693359375 is exact
    p = c(1.0 / 720)
    for k in (120, 24, 6, 2, 1, 1):
        p = p * r + c(1.0 / k)
    bias = T.broadcast(T.int32(127), lanes) if lanes > 1 else T.int32(127)
    shift = T.broadcast(T.int32(23), lanes) if lanes > 1 else T.int32(23)
    return p * T.reinterpret(f"float32x{lanes}" if lanes > 1 else "float32", (T.Cast(ity, n) + bias) << shift)


def silu(T, x, lanes: int):
    """x * sigmoid(x)."""
    return x / (const(T, 1.0, lanes) + exp(T, -x, lanes))


def _tree(T, v, lanes: int, op):
    """Reduce a vector with `op` as a tree of halving shuffles (log2(lanes) steps), where
    LLVM's own vector.reduce.fmax / fadd are strict, one lane after another."""
    from tvm import tirx

    while lanes > 1:
        half = lanes // 2
        v = op(tirx.Shuffle([v], list(range(half))), tirx.Shuffle([v], list(range(half, lanes))))
        lanes = half
    return v


def reduce_max(T, v, lanes: int):
    return _tree(T, v, lanes, T.max)


def reduce_sum(T, v, lanes: int):
    return _tree(T, v, lanes, lambda a, b: a + b)
