"""Kernels for AArch64: NEON dotprod (sdot) now; SVE2 and i8mm (smmla) variants follow."""
