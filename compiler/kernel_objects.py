"""Each kernel's machine code, kept on disk once built: TVM's TIR lowering and LLVM's code
generation were most of a compile's time (a 2-layer model: 42 of 50 s), and the same kernels
come back in every compile of a model, of its fine-tunes, and of its siblings in shape.

`build_linkable` lowers the Relax module as relax.build does, then builds each PrimFunc as a
module of its own and keeps its object file in the kernel cache's folder
(kernels/kernel_cache.py). The key is the function's TIR (its name included), the target, and
TVM's and tvm-ffi's versions: all the object depends on, so an edit of qwc that leaves a
kernel's TIR as it was still reads its object. The artifact's lib.so links those objects (as
TVM's static libraries) instead of one object built for the whole module; the code in each is
the same, so the logits are equal to the bit.

On ARM the VM's entry points are TIR too ("compiled" mode: targets.Target.vm_exec_mode), and
call each kernel by name. Built in one module, those calls bind inside it; built apart, each
becomes an undefined symbol, named as the kernel or with a ".N" suffix LLVM adds to a second
declaration of the same name. Every kernel's object exports its packed entry point as
`__tvm_ffi_<name>`, the function those calls reach, so the link defines each such name as that
symbol (`link_options`, kept with the object).

Where the folder is off (`QWC_KERNEL_CACHE=off`) or cannot be written, or `nm` is missing,
the module is built whole, as relax.build builds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .kernels.kernel_cache import cache_dir

PACKED_PREFIX = "__tvm_ffi_"   # TVM FFI's symbol for a function's packed entry point
_SUFFIXED = re.compile(r"^(.*)\.\d+$")


@dataclass
class Linkable:
    """A built module and what its link needs: `executable.export_library(..., options=link_options)`."""
    executable: object
    link_options: list[str] = field(default_factory=list)
    kernels: int = 0        # functions built as objects of their own (0: the module was built whole)
    from_cache: int = 0     # of those, read from the cache


def _key(func_module, target_str: str) -> str:
    import tvm
    import tvm_ffi

    # TVM (with its LLVM) makes the code; tvm-ffi's version names the calling convention
    h = hashlib.sha256(f"{tvm.__version__}\0{tvm_ffi.__version__}\0{target_str}\0".encode())
    h.update(tvm.ir.save_json(func_module).encode())
    return h.hexdigest()[:32]


def _stable_order(func):
    """`func` with a straight run of independent stores to constant slots in slot order. Relax's
    shape functions come out so, their statements in an order that changes from one process to
    the next (TVM's VMShapeLower walks a map keyed by pointers): the same function would be a
    new cache entry, and a new object, at random. Anything else is returned as it is."""
    from tvm import tirx

    body = func.body
    if not isinstance(body, tirx.SeqStmt):
        return func
    stores = list(body.seq)
    if not all(isinstance(st, tirx.BufferStore) and len(st.indices) == 1 and isinstance(st.indices[0], tirx.IntImm)
               and st.buffer.same_as(stores[0].buffer) for st in stores):
        return func
    written = {int(st.indices[0]) for st in stores}
    # the slots the values read, from their text (this TVM has no Python expression visitor)
    loads = re.compile(rf"\b{re.escape(stores[0].buffer.name)}\[(?:T\.int64\()?(\d+)\)?\]|\b{re.escape(stores[0].buffer.name)}\[")
    for st in stores:
        for m in loads.finditer(str(st.value)):
            if m.group(1) is None or int(m.group(1)) in written:
                return func   # a slot another store writes (or one not a constant): the program's order
    return func.with_body(tirx.SeqStmt(sorted(stores, key=lambda st: int(st.indices[0]))))


def _calls_to_kernels(obj: Path, names: set[str]) -> list[str]:
    """The undefined symbols of `obj` that name a kernel of the module, as "symbol=definition"
    pairs (see the module's docstring)."""
    out = subprocess.run(["nm", "--undefined-only", str(obj)], capture_output=True, text=True, check=True).stdout
    pairs = []
    for line in out.splitlines():
        symbol = line.split()[-1]
        m = _SUFFIXED.match(symbol)
        base = m.group(1) if m and m.group(1) in names else symbol
        if base in names:
            pairs.append(f"{symbol}={PACKED_PREFIX}{base}")
    return pairs


def _entry_ok(obj: Path, meta: Path) -> list[str] | None:
    """The entry's symbol pairs, or None where it is absent or does not match its record (a
    partial copy): such an entry is built again."""
    try:
        record = json.loads(meta.read_text())
        if hashlib.sha256(obj.read_bytes()).hexdigest() != record["sha256"]:
            return None
        return list(record["calls"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _build_one(func_module, target, obj: Path, meta: Path, names: set[str]) -> list[str]:
    import tvm

    lib = tvm.tirx.build(func_module, target=target)
    fd, tmp = tempfile.mkstemp(dir=obj.parent, prefix=".tmp-", suffix=".o")
    os.close(fd)
    try:
        lib.write_to_file(tmp)
        calls = _calls_to_kernels(Path(tmp), names)
        record = {"sha256": hashlib.sha256(Path(tmp).read_bytes()).hexdigest(), "calls": calls}
        os.replace(tmp, obj)
    except BaseException:
        os.unlink(tmp)
        raise
    fd, tmp = tempfile.mkstemp(dir=obj.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, meta)
    return calls


def _writable(where: Path | None) -> bool:
    if where is None or shutil.which("nm") is None:
        return False
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(where, os.W_OK)


def build_linkable(mod, target, exec_mode: str) -> Linkable:
    """`mod` through the Relax lowering `target` runs (pipeline.lowering), as an executable
    whose kernels are objects from the cache (the module's docstring)."""
    import tvm
    from tvm import relax
    from tvm.relax import vm_build

    from .pipeline import lowering

    where = cache_dir()
    if not _writable(where):
        return Linkable(relax.build(mod, target=target, relax_pipeline=lowering(target), exec_mode=exec_mode))
    with target:
        mod = lowering(target)(mod)
    attrs = dict(mod.attrs) if mod.attrs else {}
    params = dict(attrs.get("const_name_to_constant", {}))
    builder = relax.ExecBuilder()
    mod = vm_build._vmcodegen(builder, mod, exec_mode)
    tir = vm_build._filter_tir(mod)
    functions = list(tir.functions.items()) if tir is not None else []
    names = {gv.name_hint for gv, _ in functions}
    target_str = str(target)
    libs, options, hits = [], [], 0
    for gv, func in functions:
        one = vm_build._auto_attach_system_lib_prefix(tvm.IRModule({gv: _stable_order(func)}, attrs=tir.attrs),
                                                     target, None)
        key = _key(one, target_str)
        obj, meta = where / f"{gv.name_hint[:80]}-{key}.o", where / f"{gv.name_hint[:80]}-{key}.o.json"
        calls = _entry_ok(obj, meta)
        if calls is None:
            calls = _build_one(one, target, obj, meta, names)
        else:
            hits += 1
            with contextlib.suppress(OSError):   # recently used: what a pruning of the folder keeps
                os.utime(obj)
        for symbol, _, definition in (pair.partition("=") for pair in calls):
            options.append(f'-Wl,--defsym="{symbol}"={definition}')
        libs.append(tvm.runtime.load_static_library(str(obj), [gv.name_hint]))
    ext_libs = list(attrs.get("external_mods", []))
    lib = vm_build._ffi_api.VMLink(builder, target, None, libs + ext_libs, params)
    return Linkable(relax.VMExecutable(lib), options, len(functions), hits)
