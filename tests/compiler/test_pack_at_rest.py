"""Parameters stored at rest (compiler/pack_at_rest.py, qwc/params_at_rest.py): each form gives
every bit back, a value a form cannot hold is written as it is, and the manifest refuses an
at-rest entry that does not add up."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qwc.compiler.pack_at_rest import pack
from qwc.errors import QwcError
from qwc.manifest import Manifest
from qwc.params_at_rest import CHUNK, unpack


def _round_trip(spec, value, scales=None):
    stored = pack(spec, value, scales)
    assert stored is not None
    back = np.empty_like(value)
    unpack(spec["form"], stored, back, scales)
    assert np.array_equal(back.view(np.uint8), value.view(np.uint8))
    return stored


def _six_bit_reference(q: np.ndarray) -> np.ndarray:
    """The `six_bit` form as qwc.params_at_rest states it: u = q + 32, four in three bytes."""
    u = (q.reshape(-1, 4).astype(np.int32) + 32).astype(np.uint32)
    x = u[:, 0] | u[:, 1] << 6 | u[:, 2] << 12 | u[:, 3] << 18
    return np.stack([x & 255, x >> 8 & 255, x >> 16], axis=1).astype(np.uint8).reshape(-1)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
def test_six_bit_artifacts_of_before_still_load_across_chunks(dtype):
    """No compile writes `six_bit` now (every Q6_K kernel reads six bits), but an ARM artifact
    compiled before does: the runtime gives its codes back, int8 or their uint8 bytes."""
    rng = np.random.default_rng(0)
    q = rng.integers(-32, 32, size=CHUNK // 3 * 4 + 512 * 3).astype(np.int8).reshape(-1, 8, 64)   # past one chunk
    back = np.empty(q.shape, dtype)
    unpack("six_bit", _six_bit_reference(q), back)
    assert np.array_equal(back.view(np.int8), q)


def _q4_k(rng, g=3, b=16, free=()):
    """The kernels' expanded Q4_K factors [G, B, 16]: s = d sc and c = m + 8 s rounded once;
    `free` blocks (codes all 0) with the export's scale 1."""
    d = (rng.random((g, b // 8, 16)) * 0.01).astype(np.float16).astype(np.float32)
    dmin = (rng.random((g, b // 8, 16)) * 0.02).astype(np.float16).astype(np.float32)
    s = (np.repeat(d, 8, axis=1) * rng.integers(0, 64, (g, b, 16))).astype(np.float32)
    for at in free:
        s[at] = 1
    m = -(np.repeat(dmin, 8, axis=1) * rng.integers(0, 64, (g, b, 16))).astype(np.float32)
    return s, (m.astype(np.float64) + 8 * s.astype(np.float64)).astype(np.float32)


def test_q4_k_factors_come_back_to_the_bit_at_under_a_third_of_the_bytes():
    s, c = _q4_k(np.random.default_rng(1))
    a = _round_trip({"form": "q4_k_scales"}, s)
    b = _round_trip({"form": "q4_k_offsets", "scales": "s"}, c, s)
    assert a.nbytes * 32 == s.nbytes * 10 and b.nbytes == a.nbytes   # 1.25 bytes a block of 32, not 4


def test_q4_k_free_blocks_keep_their_scale_of_one():
    """A block whose codes are all 0 has scale 1 in the expanded form (the export's), which no
    fp16 of its super-block times 0..63 may give: it is marked, and comes back as 1."""
    s, c = _q4_k(np.random.default_rng(3), free=[(0, 0, 0), (2, 9, 15)])
    stored = _round_trip({"form": "q4_k_scales"}, s)
    assert (stored[:s.size] == 255).sum() == 2
    _round_trip({"form": "q4_k_offsets", "scales": "s"}, c, s)


def test_q4_k_forms_refuse_what_they_cannot_hold():
    rng = np.random.default_rng(2)
    s, c = _q4_k(rng)
    other = s.copy()
    other[0, 0, 0] = np.float32(0.1234567)   # no fp16 times 0..63 with its super-block
    assert pack({"form": "q4_k_scales"}, other) is None
    assert pack({"form": "q4_k_offsets", "scales": "s"}, c, other) is None   # c - 8 s is then no such minimum
    assert pack({"form": "q4_k_offsets", "scales": "s"}, c, None) is None
    assert pack({"form": "q4_k_scales"}, s[:, :12]) is None   # blocks not whole super-blocks
    assert pack({"form": "q4_k_scales"}, s.astype(np.float16)) is None


def _manifest(tiny_host_artifact, edit):
    m = json.loads((tiny_host_artifact / "manifest.json").read_text())
    edit(m)
    return m


def _at_rest(m, i, spec, nbytes=None, version=2):
    p = m["params"][i]
    p["at_rest"] = spec
    if nbytes is not None:
        p["nbytes"] = nbytes
    m["format_version"] = version


@pytest.mark.parametrize("spec, nbytes, version, message", [
    ({"form": "zstd"}, None, 2, "names no form this runtime knows"),
    ({"form": "six_bit"}, None, 2, "nbytes"),
    ({"form": "q4_k_scales"}, None, 2, "cannot hold"),
    ({"form": "six_bit"}, "3/4", 1, "format version 1 has no parameters at rest"),
])
def test_manifest_refuses_an_at_rest_entry_that_does_not_add_up(tiny_host_artifact, spec, nbytes, version, message):
    m = json.loads((tiny_host_artifact / "manifest.json").read_text())
    i = next(i for i, p in enumerate(m["params"]) if p["dtype"] in ("int8", "uint8")
             and int(np.prod(p["shape"])) % 4 == 0)
    if spec["form"] == "six_bit":
        m["params"][i]["dtype"] = "int8"
    if nbytes == "3/4":
        nbytes = m["params"][i]["nbytes"] // 4 * 3
    _at_rest(m, i, spec, nbytes, version)
    with pytest.raises(QwcError, match=message):
        Manifest.from_dict(m)


def test_manifest_refuses_offsets_without_their_scales(tiny_host_artifact):
    m = json.loads((tiny_host_artifact / "manifest.json").read_text())
    m["format_version"] = 2
    m["params"].append({"name": "c", "dtype": "float32", "shape": [1, 8, 16], "offset": 1 << 40,
                        "nbytes": 160, "at_rest": {"form": "q4_k_offsets", "scales": "nope"}})
    with pytest.raises(QwcError, match="its scales 'nope' are not a float32 parameter of its shape"):
        Manifest.from_dict(m)
    m["params"][-1]["at_rest"] = {"form": "q4_k_offsets"}
    with pytest.raises(QwcError, match="names no scales parameter"):
        Manifest.from_dict(m)
