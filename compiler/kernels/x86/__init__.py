"""Kernels for x86-64: AVX-512 VNNI (vpdpbusd) and AVX2 (vpmaddubsw + vpmaddwd), in vnni.py;
and the x86 schedule constants of the shared activation quantizer (kernels/act_quant.py,
its "plain" layout)."""

ROW_GROUP = 4          # fused_quantizer: rows a task of a many-row RMSNorm quantizer
# The silu(gate) * up quantizer computes SILU_STAGE blocks' inputs (1 KiB, on the stack)
# before it quantizes them. Each block's chain (exp, divide, then the block's max, scale and
# rounding) is ~100 instructions long end to end, and one block after another the core's
# scheduler held little more than one; staged, it overlaps several, with the same bits
# (docs/history/serving.md, "Latency chains on x86"). ARM keeps a block at a time (unmeasured
# there).
SILU_STAGE = 8
# what kernels/__init__.py's registry hands the shared quantizer for the "plain" layout
QUANTIZER_SCHEDULE = {"ROW_GROUP": ROW_GROUP, "SILU_STAGE": SILU_STAGE}
