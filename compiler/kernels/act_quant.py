"""On-the-fly activation quantization shared by the W4A8 kernels (llama.cpp's Q8_0: one fp32
scale per 32-block, scale = amax / 127, q = round(x / scale)).

Each block is stored de-interleaved — its 16 even elements, then its 16 odd ones — because a
16-byte load of packed Q4_0 weights splits into low nibbles (even elements) and high nibbles
(odd elements): the two halves line up with the two halves of the activation block.
"""

from __future__ import annotations

BLOCK = 32


def fused_quantizer(k: int, zero_point: int, one_row: bool):
    """a [M, K] float32 -> (aq [M, NB, 32] int8 de-interleaved per block, scale [M, NB],
    zero_point x block sum [M, NB]), in one pass and one kernel: separate stages would cost a
    parallel launch each, which dominates a decode step's activation work (K = 896: 28 blocks).
    `one_row` (decode) runs serially. The block sum is what a dot of raw nibbles q with a
    overcounts against (q - 8) (vpdpbusd); sdot, which takes q - 8 signed, ignores it."""
    from tvm.script import tirx as T

    nb = (k + BLOCK - 1) // BLOCK

    @T.prim_func(private=True, check_well_formed=False)
    def kernel(var_a: T.handle, var_aq: T.handle, var_ad: T.handle, var_off: T.handle):
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        m = T.int64()
        a = T.match_buffer(var_a, (m, k), "float32")
        aq = T.match_buffer(var_aq, (m, nb, BLOCK), "int8")
        ad = T.match_buffer(var_ad, (m, nb), "float32")
        off = T.match_buffer(var_off, (m, nb), "float32")
        # A root block: relax's reshape-pattern analysis insists on one for single-input kernels.
        with T.sblock("root"):
            for i in T.serial(m) if one_row else T.parallel(m):
                for b in range(nb):
                    st = T.decl_buffer((2,), "float32", scope="global")   # amax, then the block sum (global: a stack slot, see kernels/x86/vnni.py)
                    st[0] = T.float32(0)
                    for e in range(BLOCK):
                        if b * BLOCK + e < k:
                            st[0] = T.max(st[0], T.abs(a[i, b * BLOCK + e]))
                    ad[i, b] = st[0] / T.float32(127)
                    st[1] = T.float32(0)
                    for t in range(BLOCK):
                        aq[i, b, t] = T.Cast("int8", T.round(T.if_then_else(
                            ad[i, b] > T.float32(0) and b * BLOCK + T.if_then_else(t < 16, 2 * t, 2 * (t - 16) + 1) < k,
                            a[i, T.min(b * BLOCK + T.if_then_else(t < 16, 2 * t, 2 * (t - 16) + 1), k - 1)] / ad[i, b],
                            T.float32(0))))
                        st[1] = st[1] + T.Cast("float32", aq[i, b, t])
                    off[i, b] = st[1] * T.float32(zero_point)

    return kernel
