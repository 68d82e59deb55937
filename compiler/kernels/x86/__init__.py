"""Kernels for x86-64: AVX-512 VNNI (vpdpbusd)."""
