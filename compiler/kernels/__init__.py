"""TIR kernels per ISA family. `generic` is correct everywhere; ISA folders specialise.

The W4A8 builders by the names compiler/targets.py's KERNEL_RULES give them; what the W4A8
kernels share (signature, zero point, tile defaults) is in w4a8.py.
"""

# A kernel carrying this attribute was scheduled by its writer (explicit parallel, vector or
# deliberately serial loops); compiler/schedule.py's generic rule leaves it as it is and warns
# about any other kernel it cannot schedule.
SCHEDULED = "qwc.scheduled"
# Marks a decode GEMV that the decode fusions (compiler/fuse_residual_gemv.py, fuse_gate_up.py,
# sibling_gemvs.py) may merge or extend; its value is the kernel's `dot`, which the fused
# kernel is built with (decode_gemv).
DECODE_GEMV = "qwc.decode_gemv"


def hand_scheduled(func):
    return func.with_attr(SCHEDULED, True)


def w4a8_gemm(impl: str, n: int, nb: int, scale_dtype: str, tokens: int | None = None, m: int | None = None,
              batched_decode: bool = False):
    """The W4A8 prefill GEMM `impl` ("vnni", "avx2", "sdot", "smmla") for N rows, nb blocks of K;
    `tokens`: its tile width (None: the kernel's default); `m`: a fixed token count;
    `batched_decode`: the form for one token of each of B sequences, where it has one (vnni)."""
    if impl in ("vnni", "avx2"):
        from .x86 import vnni
        return vnni.q4_matmul(n, nb, scale_dtype, tokens=tokens, m=m, batched_decode=batched_decode, dot=impl)
    if impl == "sdot":
        from .arm import dotprod
        return dotprod.q4_dot(n, nb, False, scale_dtype, tokens=tokens, m=m)
    if impl == "smmla":
        from .arm import i8mm
        return i8mm.q4_gemm(n, nb, scale_dtype, tokens=tokens, m=m)
    raise ValueError(f"unknown W4A8 GEMM {impl!r}")


def gemv_dot(func) -> str:
    """The `dot` a decode GEMV kernel was built with (its DECODE_GEMV attribute)."""
    return str(func.attrs[DECODE_GEMV])


def decode_gemv(outputs: tuple[tuple[int, bool], ...], nb: int, scale_dtype: str = "float16",
                silu_mul: bool = False, quantize: int | None = None, dot: str = "vnni"):
    """The multi-output decode GEMV of `dot` ("vnni", "avx2": x86/vnni.py, with the fused
    silu(gate) * up and Q8_0 epilogues; "sdot": arm/dotprod.py, outputs with biases only)."""
    if dot == "sdot":
        if silu_mul or quantize is not None:
            raise ValueError("the ARM decode GEMV has no silu_mul / quantize epilogue")
        from .arm import dotprod
        return dotprod.decode_gemv(tuple(outputs), nb, scale_dtype)
    from .x86 import vnni
    return vnni.decode_gemv(tuple(outputs), nb, scale_dtype, silu_mul=silu_mul, quantize=quantize, dot=dot)
