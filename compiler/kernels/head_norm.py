"""Qwen3's QK-norm inside the kernels that rotate q and k: an RMSNorm over each head (its gain
of head_dim), applied as the head is read for rotary, so it costs no launch and no pass over
memory of its own.

Every kernel that norms a head takes 1 / rms from `inv_rms`, one macro, so the rotary kernel
(generic.rotary_halves: prefill, mixed steps) and the decode attention's prologue
(decode_attention.decode_attention) give the same bits: a mixed step's decode tokens and a
verify call's must attend as their decode steps do. The order is TOPI's rms_norm's (the
squares stored, then summed one after another; then x * (1 / rms) * gain), that of the norm as
imported: fused and unfused graphs agree to the bit.

The gain cannot fold into the projection before it (the norm divides by the rms of the
projection's output, which a per-column scale would change) nor through rotary into the
attention (rotate-half pairs dimension d with d + head_dim / 2, whose gains differ), so it is
applied here, one multiply an element.
"""

from __future__ import annotations


def inv_rms(T, head_dim: int, eps: float):
    """The macro `inv_rms(x, row, tok, base, r)`: r[head_dim] = 1 / sqrt(mean(x[row, tok,
    base:base + head_dim]^2) + eps), with r[:head_dim] holding the squares (r: a buffer of
    head_dim + 1 floats, a stack slot of the caller's)."""
    @T.macro
    def macro(x, row, tok, base, r):
        for e in range(head_dim):
            r[e] = x[row, tok, base + e] * x[row, tok, base + e]
        # the sum in a slot of its own, which LLVM keeps in a register: summed into r[head_dim],
        # every add was stored; held so, an SVE target sums in order by vectors (`fadda`)
        total = T.decl_buffer((1,), "float32", scope="global")
        total[0] = T.float32(0)
        for e in range(head_dim):
            total[0] = total[0] + r[e]
        r[head_dim] = T.float32(1) / T.sqrt(total[0] / T.float32(head_dim) + T.float32(eps))

    return macro
