"""qwc's benchmarks: a script a measurement, each printing its table (`python bench/NAME.py` or
`python -m qwc.bench.NAME`), and what they share: llama.cpp as the peer (`llamacpp.py`: its
tools built once, llama-bench run and read one way, its version in one place), qwc's artifacts
made once (`artifacts.py`: export -> optimize -> compile), and the emulated aarch64 machine
(`emulation.py`). Installed as qwc.bench (pyproject.toml), so a script imports its siblings
as a package, never by editing sys.path."""
