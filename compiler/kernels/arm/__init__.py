"""Kernels for AArch64: NEON dotprod (sdot, dotprod.py) and i8mm (smmla, i8mm.py); and the ARM
schedule constants of the shared activation quantizer (kernels/act_quant.py, its "arm" and
"arm_pairs" layouts)."""

PARALLEL_BLOCKS = 64   # fused_quantizer: one row's blocks run in parallel from this many on
RMS_TASKS = 4          # fused_quantizer: the tasks of one row's RMSNorm quantizer
# what kernels/__init__.py's registry hands the shared quantizer for the ARM layouts
QUANTIZER_SCHEDULE = {"PARALLEL_BLOCKS": PARALLEL_BLOCKS, "RMS_TASKS": RMS_TASKS}
