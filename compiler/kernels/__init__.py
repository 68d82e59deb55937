"""TIR kernels per ISA family. `generic` is correct everywhere; ISA folders specialise.

This module is the kernel registry, the one place that imports the ISA folders (arm/, x86/):
the W4A8 builders by the names compiler/targets.py's KERNEL_RULES give them, found through
its KERNEL_MODULES (kernel_module); the Q6_K kernels by IntDots.q6_k's names (Q6_K_MODULES,
q6_k_module); and the shared activation quantizer's schedule constants for an ISA's layouts
(quantizer_schedule). What the W4A8 kernels share (signature, zero point, the interface every
ISA module exports) is in w4a8.py. tests/test_layering.py holds every other module to it.
"""

# A kernel carrying this attribute was scheduled by its writer (explicit parallel, vector or
# deliberately serial loops); compiler/schedule.py's generic rule leaves it as it is and warns
# about any other kernel it cannot schedule.
SCHEDULED = "qwc.scheduled"
# Marks a decode GEMV that the decode fusions (compiler/fuse_residual_gemv.py, fuse_gate_up.py,
# sibling_gemvs.py) may merge or extend; its value is the kernel's `dot`, which the fused
# kernel is built with (decode_gemv).
DECODE_GEMV = "qwc.decode_gemv"
# ... and how it gets its weights ahead of use (targets.IntDots.decode_prefetch), where not
# "software": the fused kernel is built the same way
DECODE_PREFETCH = "qwc.decode_prefetch"
PREFETCHES = ("software", "hardware")


# The module under compiler/kernels that builds each Q6_K kernel IntDots.q6_k names
Q6_K_MODULES = {"vnni": "x86.q6_k", "sdot": "arm.q6_k"}
# The ISA folder whose schedule constants each activation layout of act_quant.fused_quantizer takes
LAYOUT_ISA = {"plain": "x86", "arm": "arm", "arm_pairs": "arm", "arm_rows": "arm", "arm_rows_flat": "arm"}


def q6_k_module(name: str):
    """The module that builds the Q6_K kernel `name` (targets.IntDots.q6_k: "vnni", "sdot")."""
    import importlib

    if name not in Q6_K_MODULES:
        raise ValueError(f"unknown Q6_K kernel {name!r} (known: {', '.join(Q6_K_MODULES)})")
    return importlib.import_module(f"{__name__}.{Q6_K_MODULES[name]}")


def quantizer_schedule(layout: str) -> dict:
    """The schedule constants of the activation quantizer's `layout`, from the ISA folder that
    owns it (its QUANTIZER_SCHEDULE)."""
    import importlib

    return importlib.import_module(f"{__name__}.{LAYOUT_ISA[layout]}").QUANTIZER_SCHEDULE


def dot_bits(dot: str) -> int:
    """The weights' bits a kernel by this name reads: the W8A8 forms ("vnni8", "sdot8",
    "smmla8": targets.KERNEL_MODULES) Q8_0 codes, "vnni5" / "sdot5" five-bit codes
    (row_groups.pack_five_bit), the others Q4_0 nibbles."""
    return 8 if dot.endswith("8") else 5 if dot.endswith("5") else 4


def hand_scheduled(func):
    return func.with_attr(SCHEDULED, True)


def kernel_module(dot: str):
    """The ISA module that builds the W4A8 kernel `dot` ("vnni", "avx2", "sdot", "smmla"):
    compiler/targets.py's KERNEL_MODULES names it; it must have kernels/w4a8.py's KernelModule
    interface."""
    import importlib

    from ..targets import KERNEL_MODULES
    from .w4a8 import KernelModule

    if dot not in KERNEL_MODULES:
        raise ValueError(f"unknown W4A8 kernel {dot!r} (known: {', '.join(KERNEL_MODULES)})")
    mod = importlib.import_module(f"{__name__}.{KERNEL_MODULES[dot]}")
    if not isinstance(mod, KernelModule):
        missing = [m for m in ("DEFAULT_TOKENS", "DECODE_EPILOGUES", "PREFILL_BIAS", "prefill_gemm", "decode_gemv")
                   if not hasattr(mod, m)]
        raise TypeError(f"{mod.__name__} (W4A8 kernel {dot!r}) lacks {', '.join(missing)} of kernels/w4a8.py's "
                        f"KernelModule")
    return mod


def w4a8_gemm(dot: str, n: int, nb: int, scale_dtype: str, tokens: int | None = None, m: int | None = None,
              batched_decode: bool = False, offsets: bool = False, bias: bool = False, amx: bool = False,
              per_row: bool = False):
    """The W4A8 prefill GEMM `dot` for N rows, nb blocks of K; `tokens`: its tile width (None:
    the module's DEFAULT_TOKENS); `m`: a fixed token count; `batched_decode`: the form for one
    token of each of B sequences, where it has one (vnni, avx2); `offsets`: with Q4_1's block
    offsets (an argument after the scales); `bias`: adding a bias [N] (the argument after
    those) as it stores, where `prefill_bias(dot)`; `amx`: its whole 16-token tiles on AMX
    (x86 only: targets.IntDots.amx); `per_row`: activations with a scale and zero point a row,
    the weight rows' sums an argument after the scales (targets.IntDots.row_layout names the
    targets whose GEMM has the form)."""
    extra = {"bias": True} if bias else {}
    if amx:
        extra["amx"] = True
    if per_row:
        extra["per_row"] = True
    if bias and not prefill_bias(dot):
        raise ValueError(f"the {dot} prefill GEMM adds no bias")
    return kernel_module(dot).prefill_gemm(n, nb, scale_dtype, tokens=tokens, m=m, batched_decode=batched_decode,
                                            dot=dot, offsets=offsets, **extra)


def prefill_bias(dot: str) -> bool:
    """Whether the prefill GEMM of `dot` can add a bias as it stores (its PREFILL_BIAS)."""
    return kernel_module(dot).PREFILL_BIAS


def gemv_dot(func) -> str:
    """The `dot` a decode GEMV kernel was built with (its DECODE_GEMV attribute)."""
    return str(func.attrs[DECODE_GEMV])


def gemv_prefetch(func) -> str:
    """How a decode GEMV kernel was built to prefetch (its DECODE_PREFETCH attribute)."""
    return str(func.attrs.get(DECODE_PREFETCH, "software"))


def decode_epilogues(dot: str) -> frozenset[str]:
    """What the decode GEMV of `dot` can do as it stores: "bias" (a bias or the residual),
    "silu_mul" (gate and up as silu(gate) * up), "quantize" (that as Q8_0 blocks), "split"
    (one output's blocks in parts, summed by the RMSNorm quantizer that reads them)."""
    return kernel_module(dot).DECODE_EPILOGUES


def weight_args(args) -> list[tuple[bool, bool]]:
    """(with block offsets, with bias) of each output of a decode GEMV call's arguments `args`
    (Relax expressions: aq, ad, off, then per output w [G, nb, chunks, 64], s, the block
    offsets [G, nb, 16] if it has them, the bias [N] if it has one)."""
    out, rest = [], list(args[3:])
    while rest:
        if len(rest) < 2 or len(rest[0].ty.shape) != 4:
            raise ValueError("a decode GEMV's weights come as (w, s[, offsets][, bias]) per output")
        rest = rest[2:]
        offsets = bool(rest) and len(rest[0].ty.shape) == 3
        rest = rest[offsets:]
        bias = bool(rest) and len(rest[0].ty.shape) == 1
        rest = rest[bias:]
        out.append((offsets, bias))
    return out


def decode_gemv(outputs: tuple[tuple, ...], nb: int, scale_dtype: str = "float16",
                silu_mul: bool = False, quantize: int | None = None, dot: str = "vnni", split: int = 1,
                prefetch: str = "software"):
    """The multi-output decode GEMV of `dot` (outputs = ((N, with bias[, with block offsets]),
    ...): the offsets are Q4_1's, compiler/repack.py: q4_1_block_offsets); `split` > 1: one
    output's blocks in that many parts, y [split, N] (the "split" epilogue); `prefetch`: the
    target's IntDots.decode_prefetch ("hardware" only where the module's kernel has the form)."""
    if prefetch not in PREFETCHES:
        raise ValueError(f"unknown decode prefetch {prefetch!r} (known: {', '.join(PREFETCHES)})")
    outputs = tuple((o[0], bool(o[1]), bool(o[2]) if len(o) > 2 else False) for o in outputs)
    want = {"bias"} if any(o[1] for o in outputs) else set()
    want |= {"silu_mul"} if silu_mul else set()
    want |= {"quantize"} if quantize is not None else set()
    want |= {"split"} if split != 1 else set()
    if not want <= decode_epilogues(dot):
        raise ValueError(f"the {dot} decode GEMV has no {', '.join(sorted(want - decode_epilogues(dot)))} epilogue")
    extra = {"split": split} if split != 1 else {}
    if prefetch != "software":
        extra["prefetch"] = prefetch
    return kernel_module(dot).decode_gemv(tuple(outputs), nb, scale_dtype, silu_mul=silu_mul, quantize=quantize,
                                          dot=dot, **extra)


# Before any kernel module parses its TVMScript (macro_lookup.py: TVMScript's macro calls
# without reading every frame's source).
from .macro_lookup import install as _install_macro_lookup  # noqa: E402

_install_macro_lookup()
