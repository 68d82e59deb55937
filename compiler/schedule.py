"""A generic CPU schedule for every kernel no ISA-specific rule claims: the leading spatial
loops of each block are fused and run in parallel, and injective blocks are split by the
vector width and vectorised.

Without it TVM's default CPU pipeline emits single-threaded scalar loops (5.3 s a
token on a 0.5B-shaped model). It is deliberately simple: the speed issue replaces the hot
kernels (GEMV/GEMM, attention) with hand-scheduled ones; this keeps everything else parallel.
"""

from __future__ import annotations

import os
import sys

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func

from qwc.errors import QwcError

from .kernels import SCHEDULED, hand_scheduled

VECTOR_LANES = 8  # fp32 lanes of a 256-bit vector; LLVM splits or widens for the target
# Below this many output elements an elementwise kernel costs less than a parallel launch (a
# decode step's rotary and residual adds are 64-5000 elements): run those on the calling thread.
MIN_PARALLEL = 1 << 14


def schedule_func(func: tirx.PrimFunc, name: str = "kernel") -> tirx.PrimFunc:
    sch = s_tir.Schedule(func)
    try:
        infos = normalize_prim_func(sch)
    except Exception:
        infos = None
    if not infos:
        _unscheduled(name, "its loops are not in a form the generic rule reads")
        return func
    for info in reversed(infos):
        try:
            _schedule_block(sch, info)
        except (s_tir.ScheduleError, tvm.error.TVMError) as e:
            _unscheduled(name, f"a block refused the generic rule ({str(e).strip().splitlines()[0][:120]})")
    return sch.mod["main"]


# Set to "error" (the test suite does), an unscheduled kernel stops the build instead of warning.
STRICT_ENV = "QWC_UNSCHEDULED"


def _unscheduled(name: str, why: str) -> None:
    """Loud, not silent: an unscheduled kernel runs single-threaded scalar loops (a hot one would
    be most of a step's time)."""
    msg = f"kernel {name} left unscheduled (serial, scalar): {why}"
    if os.environ.get(STRICT_ENV) == "error":
        raise QwcError(msg)
    print(f"qwc: warning: {msg}", file=sys.stderr, flush=True)


def _schedule_block(sch, info) -> None:
    lead = []
    for it in info.iters:
        if it.kind != "S":
            break
        lead.append(it.loop_rv)
    if not lead:
        return
    injective = all(it.kind == "S" for it in info.iters)
    if injective and len(lead) > 1 and _dynamic_rows(sch, lead):
        # [M, N] with M a token count (a prefill or step's bias and residual adds): the fused
        # extent is no constant to split by the vector width, but the row is. Fused whole, the
        # loop stayed scalar, and a mixed step's bias adds showed in its profile.
        outer, inner = sch.split(lead[-1], [None, VECTOR_LANES])
        sch.parallel(sch.fuse(*lead[:-1], outer))
        sch.vectorize(inner)
        return
    fused = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    ext = sch.get(fused).extent
    # Elementwise work below MIN_PARALLEL is too small to share; a reduction does K work per
    # output, so only a single output stays on the calling thread.
    small = isinstance(ext, tirx.IntImm) and (ext.value < 2 or injective and ext.value < MIN_PARALLEL)
    if injective and isinstance(ext, tirx.IntImm) and ext.value >= 4 * VECTOR_LANES and ext.value % VECTOR_LANES == 0:
        outer, inner = sch.split(fused, [None, VECTOR_LANES])
        if not small:
            sch.parallel(outer)
        sch.vectorize(inner)
    elif not small:
        sch.parallel(fused)


def _dynamic_rows(sch, loops) -> bool:
    """Whether the outer loops' extent is not a constant and the innermost one's is a multiple
    of the vector width."""
    extents = [sch.get(lp).extent for lp in loops]
    last = extents[-1]
    return (not all(isinstance(e, tirx.IntImm) for e in extents[:-1]) and isinstance(last, tirx.IntImm)
            and last.value >= VECTOR_LANES and last.value % VECTOR_LANES == 0)


@tvm.transform.module_pass(opt_level=0, name="qwc.GenericCPUSchedule")
def generic_cpu_schedule(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    updates = {}
    for gv, fn in mod.functions_items():
        if isinstance(fn, tirx.PrimFunc) and not (fn.attrs and SCHEDULED in fn.attrs):
            updates[gv] = hand_scheduled(schedule_func(fn, gv.name_hint))
    for gv, fn in updates.items():
        mod[gv] = fn
    return mod
