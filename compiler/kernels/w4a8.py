"""What every W4A8 Q4_0 matmul kernel shares, so each ISA file (x86/vnni.py, arm/dotprod.py,
arm/i8mm.py) holds only its dot product and its tiling.

- the signature: y [M, N] = the quantized activations (aq [M, NB, 32] int8, de-interleaved
  per block; their scales ad; the zero point x block sums off, act_quant.fused_quantizer) times
  the row-group weights (w [groups, NB, 4, 64] uint8, or [groups, NB, 8, 64] for the W8A8
  forms' Q8_0 codes, and their scales [groups, NB, 16], kernels/row_groups.py), plus Q4_1's
  block offsets times the activations' block sums where the kernel takes them (gemm_kernel's
  `offsets`); M any number of tokens or fixed (`qwc tune` measures at fixed M);
- the zero point: every kernel takes the nibbles q (0..15) as they are and starts its
  accumulation from ZERO_POINT x sum(a) per block, which the quantizer writes, so
  dot(q - 8, a) costs no subtraction;
- the store of a vector of rows with the ragged last row group (N not a multiple of 16) row
  by row;

Each ISA module (x86/vnni.py, arm/dotprod.py, arm/i8mm.py) exports the same interface,
`KernelModule`, which kernels/__init__.py checks as it loads the module by the name
compiler/targets.py's KERNEL_MODULES gives it.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from tvm import tirx
from tvm.script import tirx as T

from . import iq4_xs_scales
from .row_groups import ROWS, groups

ZERO_POINT = -8


@runtime_checkable
class KernelModule(Protocol):
    """The interface of an ISA's W4A8 module."""

    DEFAULT_TOKENS: dict[str, int]     # the hand-scheduled GEMM's tile width, per kernel name it builds
    DECODE_EPILOGUES: frozenset[str]   # what its decode GEMV adds as it stores (kernels.decode_epilogues)
    PREFILL_BIAS: bool                 # whether prefill_gemm(..., bias=True) adds a bias as it stores

    def prefill_gemm(self, n: int, nb: int, scale_dtype: str, tokens: int | None = None, m: int | None = None,
                     batched_decode: bool = False, dot: str = "", offsets: bool = False, **epilogue):
        """The prefill GEMM for N rows and nb blocks of K (this module's signature above)."""

    def decode_gemv(self, outputs: tuple[tuple[int, bool, bool], ...], nb: int, scale_dtype: str = "float16",
                    silu_mul: bool = False, quantize: int | None = None, dot: str = "", **epilogue):
        """The multi-output decode GEMV (outputs: (N, with bias, with block offsets)); a
        prefill-only module raises ValueError."""


def token_count(m: int | None):
    """M: a symbolic token count, or `m` fixed."""
    return tirx.Var("m", "int64") if m is None else m


def gemm_kernel(n: int, nb: int, scale_dtype: str, rows_in, body, pair_scales: bool = False, chunks: int = 4,
                offsets: bool = False, bias: bool = False, row_sums: bool = False, isa: str = "x86",
                book: bool = False):
    """The PrimFunc of a W4A8 matmul whose root block is the macro `body(w, aq, off, ws, ad, y,
    wc)`. The offsets off are int32: they start the integer accumulators. `pair_scales`: ad and
    off are [M, NB, 2] (act_quant layout "arm_pairs"); `chunks`: the weights' 64-byte chunks a
    block (8: Q8_0 codes, row_groups.pack_int8); `offsets`: Q4_1's block offsets wc [G, NB, 16]
    float32 follow the scales (else wc is None), or Q4_K's super-block factors where the
    scales are its compact ones (kernels/q4_k_scales.py gives the shapes); `bias`: a bias [N]
    float32 follows those, and the body takes it last (`body(w, aq, off, ws, ad, y, wc, bias)`)
    to add as it stores; `row_sums`: the activations are per row (act_quant.ROW_LAYOUTS: ad
    [M, 2] holds each row's scale and scale x zero point) and each weight row's sum of its
    values rs [N] float32 follows the scales, which the body takes last in the place of a bias
    (kernels/arm/i8mm.py, kernels/arm/dotprod.py). `isa`: the weights' layout ("x86" | "arm":
    compact Q4_K's scales differ, iq4_xs_scales.kernel_buffers); `book`: the kernel reads 4-bit indices
    into the book (compact scales are then IQ4_XS's)."""
    ng = groups(n)
    act = (rows_in, nb, 2) if pair_scales else (rows_in, nb)
    if row_sums and (offsets or bias):
        raise ValueError("the per-row GEMM takes neither block offsets nor a bias")
    ws_shape, ws_dtype, wc_shape, wc_dtype = iq4_xs_scales.kernel_buffers(scale_dtype, ng, nb, isa, book)

    @T.macro
    def root(var_aq, var_ad, var_off, var_y, w, ws, wc, bias):
        """Every variant's body: its activation and output buffers, and the body in the root block."""
        T.func_attr({"tir.noalias": True, "op_pattern": 8})  # opaque: FuseOps leaves it whole
        aq = T.match_buffer(var_aq, (rows_in, nb, 32), "int8")
        ad = T.match_buffer(var_ad, (rows_in, 2) if row_sums else act, "float32")
        off = T.match_buffer(var_off, act, "int32")
        y = T.match_buffer(var_y, (rows_in, n), "float32")
        with T.sblock("root"):   # named, so a tuning trace can annotate it (compiler/tuning.py)
            if bias is None:   # decided when the kernel is built
                body(w, aq, off, ws, ad, y, wc)
            else:
                body(w, aq, off, ws, ad, y, wc, bias)

    # one variant a signature (a prim_func's arguments are fixed): offsets and bias, each or
    # not; or the row sums
    if row_sums:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel_r(var_aq: T.handle, var_ad: T.handle, var_off: T.handle,
                     w: T.Buffer((ng, nb, chunks, 4 * ROWS), "uint8"), ws: T.Buffer(ws_shape, ws_dtype),
                     rs: T.Buffer((n,), "float32"), var_y: T.handle):
            root(var_aq, var_ad, var_off, var_y, w, ws, None, rs)
        return kernel_r

    if not offsets and not bias:
        @T.prim_func(private=True, check_well_formed=False)   # the named root block (as in act_quant)
        def kernel(var_aq: T.handle, var_ad: T.handle, var_off: T.handle,
                   w: T.Buffer((ng, nb, chunks, 4 * ROWS), "uint8"), ws: T.Buffer(ws_shape, ws_dtype),
                   var_y: T.handle):
            root(var_aq, var_ad, var_off, var_y, w, ws, None, None)
        return kernel

    if not bias:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel_c(var_aq: T.handle, var_ad: T.handle, var_off: T.handle,
                     w: T.Buffer((ng, nb, chunks, 4 * ROWS), "uint8"), ws: T.Buffer(ws_shape, ws_dtype),
                     wc: T.Buffer(wc_shape, wc_dtype), var_y: T.handle):
            root(var_aq, var_ad, var_off, var_y, w, ws, wc, None)
        return kernel_c

    if not offsets:
        @T.prim_func(private=True, check_well_formed=False)
        def kernel_b(var_aq: T.handle, var_ad: T.handle, var_off: T.handle,
                     w: T.Buffer((ng, nb, chunks, 4 * ROWS), "uint8"), ws: T.Buffer(ws_shape, ws_dtype),
                     bias: T.Buffer((n,), "float32"), var_y: T.handle):
            root(var_aq, var_ad, var_off, var_y, w, ws, None, bias)
        return kernel_b

    @T.prim_func(private=True, check_well_formed=False)
    def kernel_cb(var_aq: T.handle, var_ad: T.handle, var_off: T.handle,
                  w: T.Buffer((ng, nb, chunks, 4 * ROWS), "uint8"), ws: T.Buffer(ws_shape, ws_dtype),
                  wc: T.Buffer(wc_shape, wc_dtype), bias: T.Buffer((n,), "float32"), var_y: T.handle):
        root(var_aq, var_ad, var_off, var_y, w, ws, wc, bias)
    return kernel_cb


def block_sum_factor(halved: bool = False) -> float:
    """What turns a block's quantizer offset (ZERO_POINT x the sum of its codes) times its scale
    into the activations' block sum (scale x sum of the codes), which Q4_1's block offsets
    multiply: 1 / ZERO_POINT, halved for the ARM kernels' halved sums (arm/dotprod.py:
    halved_float). A power of two: exact."""
    return (0.5 if halved else 1.0) / ZERO_POINT


def block_sum_shift(halved: bool = False) -> int:
    """s with block_sum_factor(halved) = -2^-s: the ARM kernels convert the offsets with s
    fractional bits and subtract their term (arm/dotprod.py: negated_block_sums)."""
    f = block_sum_factor(halved)
    s = round(-math.log2(-f))
    assert f == -(2.0 ** -s), f
    return s


@T.macro
def store_rows(y, t, row, lanes: int, n: int, acc, base, factor, bias=None):
    """y[t, row .. row + lanes - 1] = acc[base ..] (times `factor` unless None; plus bias[row
    ..] unless None); where the rows pass N (the ragged last group), only those below N, one
    at a time."""
    if n % ROWS == 0 or row + lanes <= n:
        if factor is None and bias is None:
            y[t, T.ramp(row, 1, lanes)] = acc[T.ramp(base, 1, lanes)]
        elif bias is None:
            y[t, T.ramp(row, 1, lanes)] = acc[T.ramp(base, 1, lanes)] * T.broadcast(T.float32(factor), lanes)
        else:   # (no kernel has both)
            y[t, T.ramp(row, 1, lanes)] = acc[T.ramp(base, 1, lanes)] + bias[T.ramp(row, 1, lanes)]
    else:
        for r in range(lanes):
            if row + r < n:
                if factor is None and bias is None:
                    y[t, row + r] = acc[base + r]
                elif bias is None:
                    y[t, row + r] = acc[base + r] * T.float32(factor)
                else:
                    y[t, row + r] = acc[base + r] + bias[row + r]
