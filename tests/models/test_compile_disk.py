"""A compile's disk: the weights the passes and the repacking make go to a scratch file
(qwc/weight_file.py), whose tensors give their disk back as soon as nothing will read them, and
a GGUF's blocks are read where they are, not copied in (a 32B's compile needed three times its
artifact's 18 GB free). Holes punched in the scratch file must never touch a tensor still read:
the artifact is the same byte for byte as without them."""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from test_gguf_formats import _config, write_random_model

from qwc import weight_file
from qwc.cli import main
from qwc.compiler import artifact
from qwc.passes.graph import active_weight_file
from qwc.weight_file import WeightFile


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_release_gives_back_a_tensors_disk_and_keeps_the_others(tmp_path):
    wf = WeightFile(tmp_path / "w.bin")
    a, b, c = (np.full((300, 1000), v, np.float32) for v in (1, 2, 3))
    ta, tb, tc = wf.add(a, "a"), wf.add(b, "b"), wf.add(c, "c")
    offset = {t.name: int(next(e.value for e in t.external_data if e.key == "offset")) for t in (ta, tb, tc)}
    before = _allocated(wf.path)
    assert wf.release([offset["b"], 12345]) >= b.nbytes   # an offset it never wrote is no tensor
    assert before - _allocated(wf.path) >= b.nbytes and wf.held() == {offset["a"], offset["c"]}
    assert wf.release([offset["b"]]) == 0   # released once
    wf.close()
    from qwc.passes.graph import tensor_array
    assert np.array_equal(tensor_array(ta), a) and np.array_equal(tensor_array(tc), c)
    assert not tensor_array(tb).any()   # a hole reads as zeros


@pytest.fixture(scope="module")
def q4_0_graph(tmp_path_factory):
    """The exported graph of a Q4_0 GGUF whose weights are large enough (>= 64 KiB) to be
    written to weight files rather than held in the graph."""
    d = tmp_path_factory.mktemp("disk")

    def matrix(rng, name, shape):
        return quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), Q.Q4_0), Q.Q4_0

    write_random_model(d / "m.gguf", _config("tiny-disk", hidden=512, intermediate=1024), matrix, 0)
    assert main(["-q", "export", str(d / "m.gguf"), "-o", str(d / "m.onnx")]) == 0
    return d / "m.onnx"


def test_a_compile_holds_its_weights_on_disk_once_and_writes_the_same_artifact(q4_0_graph, tmp_path, monkeypatch):
    copied, scratch_left = [], []
    copy_in, write_params = WeightFile.copy_in, artifact.write_params

    def counting_copy_in(self, t):
        copied.append(t.name)
        return copy_in(self, t)

    def checked_write_params(path, names, values, at_rest=None):
        index = write_params(path, names, values, at_rest)
        wf = active_weight_file()
        scratch_left.append((wf.held(), _allocated(wf.path), os.path.getsize(path)))
        return index

    monkeypatch.setattr(WeightFile, "copy_in", counting_copy_in)
    monkeypatch.setattr(artifact, "write_params", checked_write_params)
    assert main(["-q", "compile", str(q4_0_graph), "-o", str(tmp_path / "a.qwc")]) == 0
    assert copied == []   # the GGUF's blocks were read from the export's data file
    held, allocated, params = scratch_left[0]
    assert held == set() and allocated < params // 20   # every scratch tensor released once written
    # the same artifact where no hole is punched (the scratch file then keeps every byte)
    monkeypatch.setattr(weight_file, "_punch_hole", lambda fd, offset, length: False)
    assert main(["-q", "compile", str(q4_0_graph), "-o", str(tmp_path / "b.qwc")]) == 0
    assert scratch_left[1][1] > scratch_left[1][2] // 2   # (unpunched, the repacked weights stay)
    assert (tmp_path / "a.qwc" / "params.bin").read_bytes() == (tmp_path / "b.qwc" / "params.bin").read_bytes()
