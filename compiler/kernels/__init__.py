"""TIR kernels per ISA family. `generic` is correct everywhere; ISA folders specialise."""
