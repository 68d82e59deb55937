"""Export in bounded memory (models/stream_export.py) and the lazily read optimize: the
streamed graph against torch's export and transformers, on the exact layer structures of the
Qwen2.5 families, and the same Q4_0 bytes whichever way the graph was made."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import save_file

from qwc.cli import main
from qwc.config import ModelConfig, sidecar_paths
from qwc.models import load as load_mod
from qwc.models.checkpoint import expected_tensors
from qwc.models.hf import open_hf_dir
from qwc.models.qwen2 import from_checkpoint
from qwc.models.tokenizer import byte_level_tokenizer, special_ids
from qwc.passes.graph import LARGE_TENSOR_BYTES, new_tensor, tensor_array, tensor_bytes, weights_to
from qwc.passes.options import PassOptions
from qwc.passes.pipeline import STREAM_EXPORT_KEY, load_canonical, load_graph, optimize

from conftest import ort_kv_logits, torch_kv_logits


def _steps(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, (1, 8)), [rng.integers(0, cfg.vocab_size, (1, 1)) for _ in range(4)]


def _q4_tensors(path) -> dict[str, np.ndarray]:
    m = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer
            if t.name.endswith(("qweight", "scales")) or ".qweight_" in t.name or ".scales_" in t.name}


@pytest.mark.slow
def test_stream_export_equals_torch_export_and_quantizes_to_the_same_bytes(tiny_lm, tmp_path):
    src = tmp_path / "hf"
    tiny_lm.model.save_pretrained(src)
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    for how in ("torch", "stream"):
        assert main(["-q", "export", str(src), "-o", str(tmp_path / f"{how}.onnx"), "--exporter", how]) == 0
        assert main(["-q", "optimize", str(tmp_path / f"{how}.onnx"), "-o", str(tmp_path / f"{how}.q4.onnx")]) == 0
    streamed = onnx.load(str(tmp_path / "stream.onnx"), load_external_data=False)
    assert any(p.key == STREAM_EXPORT_KEY for p in streamed.metadata_props)
    assert (tmp_path / "stream.onnx.data").stat().st_size > 1_000_000   # the weights are external
    cfg = ModelConfig.load(sidecar_paths(tmp_path / "stream.onnx")[0])
    prompt, steps = _steps(cfg)
    a = ort_kv_logits(tmp_path / "stream.onnx", cfg, prompt, steps)
    b = ort_kv_logits(tmp_path / "torch.onnx", cfg, prompt, steps)
    for x, y in zip(a, b):
        assert np.abs(x - y).max() <= 1e-5 * max(1.0, np.abs(y).max())
    # The passes give the same Q4_0 bytes and scales, under the same names, and the same logits.
    qa, qb = _q4_tensors(tmp_path / "stream.q4.onnx"), _q4_tensors(tmp_path / "torch.q4.onnx")
    assert set(qa) == set(qb) and len(qa) == 2 * (7 * 2 + 1)   # 7 linears a layer + the embedding
    assert all(np.array_equal(qa[k], qb[k]) for k in qa)
    assert not any(p.key == STREAM_EXPORT_KEY for p in onnx.load(str(tmp_path / "stream.q4.onnx")).metadata_props)
    a = ort_kv_logits(tmp_path / "stream.q4.onnx", cfg, prompt, steps)
    b = ort_kv_logits(tmp_path / "torch.q4.onnx", cfg, prompt, steps)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    # `qwc compile` of the streamed float graph runs the passes (it has the fused ops already,
    # but its marker says it is not the canonical int4 graph).
    direct = load_canonical(tmp_path / "stream.onnx", cfg)
    assert sum(n.op_type == "MatMulNBits" for n in direct.graph.node) == 7 * 2 + 1


# The layer structures of the Qwen2.5 sizes, small: (hidden, intermediate, heads, kv heads,
# head_dim, tied). 0.5B: head_dim 64, tied; 1.5B/3B: head_dim 128, 2 KV heads, tied;
# 7B: head_dim 128, 4 KV heads (7 query heads each there; 2 here), its own lm_head.
# Intermediate sizes are whole 32-blocks but not multiples of 128, as 4864 / 8960 / 18944 are not all.
FAMILIES = {
    "0.5b": (256, 352, 4, 2, 64, True),
    "1.5b": (512, 864, 4, 2, 128, True),
    "7b": (1024, 1376, 8, 4, 128, False),
}


def _hub_dir(path, family: str, dtype=torch.bfloat16):
    """A hub-style directory: bf16 (or `dtype`) weights in two safetensors shards with an index."""
    h, inter, heads, kv, hd, tied = FAMILIES[family]
    tok = byte_level_tokenizer()
    bos, eos = special_ids(tok)
    cfg = ModelConfig(name=family, vocab_size=320, hidden_size=h, intermediate_size=inter,
                      num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                      tie_word_embeddings=tied, bos_token_id=bos, eos_token_ids=eos)
    gen = torch.Generator().manual_seed(1)
    names = list(expected_tensors(cfg).items())
    path.mkdir()
    weight_map = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        state = {n: ((1 + 0.1 * torch.randn(s, generator=gen)) if n.endswith("norm.weight")
                     else 0.05 * torch.randn(s, generator=gen)).to(dtype) for n, s in part}
        save_file(state, str(path / fname))
        weight_map.update({n: fname for n in state})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "torch_dtype": "bfloat16", "vocab_size": cfg.vocab_size, "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": 512, "tie_word_embeddings": tied, "bos_token_id": bos, "eos_token_id": eos[0]}))
    tok.save(str(path / "tokenizer.json"))
    return cfg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stream_export_of_each_family_matches_transformers(tmp_path, family):
    """bf16 shards -> streamed float graph: onnxruntime against transformers on the same
    (bf16-rounded) weights, prefill and decode steps through the KV cache."""
    cfg = _hub_dir(tmp_path / "hf", family)
    out = tmp_path / "m.onnx"
    assert main(["-q", "export", str(tmp_path / "hf"), "-o", str(out), "--exporter", "stream"]) == 0
    got_cfg = ModelConfig.load(sidecar_paths(out)[0])
    assert (got_cfg.head_dim, got_cfg.tie_word_embeddings) == (cfg.head_dim, cfg.tie_word_embeddings)
    ref = from_checkpoint(open_hf_dir(tmp_path / "hf")).model
    prompt, steps = _steps(cfg, seed=2)
    for r, g in zip(torch_kv_logits(ref, prompt, steps), ort_kv_logits(out, got_cfg, prompt, steps)):
        assert np.abs(r - g).max() < 1e-4


def test_optimize_reads_a_streamed_graph_lazily(tmp_path):
    """`qwc optimize` keeps external weights on disk until a pass needs one: after loading,
    no large initializer is in memory, and the result is the eagerly loaded graph's."""
    _hub_dir(tmp_path / "hf", "7b")
    out = tmp_path / "m.onnx"
    assert main(["-q", "export", str(tmp_path / "hf"), "-o", str(out), "--exporter", "stream"]) == 0
    lazy = load_graph(out, lazy=True)
    big = [t for t in lazy.graph.initializer if np.prod(t.dims) * 4 > 4096]
    assert big and all(t.data_location == onnx.TensorProto.EXTERNAL and not t.raw_data for t in big)
    eager = load_graph(out)
    for t in big[:3]:
        e = next(x for x in eager.graph.initializer if x.name == t.name)
        assert np.array_equal(tensor_array(t), onnx.numpy_helper.to_array(e))
    assert main(["-q", "optimize", str(out), "-o", str(tmp_path / "m.q4.onnx")]) == 0
    ref = optimize(eager, PassOptions(config=ModelConfig.load(sidecar_paths(out)[0])))
    want = {t.name: onnx.numpy_helper.to_array(t) for t in ref.graph.initializer}
    got = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "m.q4.onnx")).graph.initializer}
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)
    # Each quantized weight went to the output's own data file as it was made: the graph names
    # it relative to itself, and the file holds those tensors and nothing else.
    q4 = onnx.load(str(tmp_path / "m.q4.onnx"), load_external_data=False)
    ext = [t for t in q4.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {t.name for t in ext} == {t.name for t in ref.graph.initializer if tensor_bytes(t) >= LARGE_TENSOR_BYTES}
    assert {e.value for t in ext for e in t.external_data if e.key == "location"} == {"m.q4.onnx.data"}
    data = (tmp_path / "m.q4.onnx.data").stat().st_size
    assert sum(tensor_bytes(t) for t in ext) <= data < sum(tensor_bytes(t) for t in ext) + 4096 * len(ext)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("m.q4")) == [
        "m.q4.config.json", "m.q4.onnx", "m.q4.onnx.data", "m.q4.tokenizer.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no staging left


def _as_float32(src, dst) -> None:
    """A copy of hub directory `src` with every tensor in float32 (the same values)."""
    from safetensors.torch import load_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.float() for k, v in load_file(str(f)).items()}, str(dst / f.name))
        else:
            (dst / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize("family,dtype", [("0.5b", "bfloat16"), ("7b", "bfloat16"), ("0.5b", "float16")])
def test_a_bf16_or_fp16_checkpoint_exports_so_and_optimizes_to_the_float32_graphs_bytes(tmp_path, family, dtype):
    """A bf16 (fp16) checkpoint's matrices go to the graph in bf16 (fp16) behind a Cast (half
    the disk), and everything after the export is as from the float32 graph of the same values:
    the same Q4_0 bytes, the same float weights kept by --keep-float, the same onnxruntime logits."""
    _hub_dir(tmp_path / "hf", family, getattr(torch, dtype))
    _as_float32(tmp_path / "hf", tmp_path / "hf32")
    for src, name in ((tmp_path / "hf", "b"), (tmp_path / "hf32", "f")):
        assert main(["-q", "export", str(src), "-o", str(tmp_path / f"{name}.onnx"), "--exporter", "stream"]) == 0
        assert main(["-q", "optimize", str(tmp_path / f"{name}.onnx"), "-o", str(tmp_path / f"{name}.q4.onnx"),
                     "--keep-float", "*down_proj"]) == 0
    graph = onnx.load(str(tmp_path / "b.onnx"), load_external_data=False).graph
    halves = [t for t in graph.initializer if t.data_type == getattr(onnx.TensorProto, dtype.upper())]
    assert len(halves) == 2 * 7 + 1 + (family == "7b")   # the linears, the embedding, an untied head
    assert sum(n.op_type == "Cast" and n.input[0] in {t.name for t in halves} for n in graph.node) == len(halves)
    size = {n: (tmp_path / f"{n}.onnx.data").stat().st_size for n in "bf"}
    assert 0.45 < size["b"] / size["f"] < 0.55
    cfg = ModelConfig.load(sidecar_paths(tmp_path / "b.onnx")[0])
    prompt, steps = _steps(cfg, seed=3)
    for x, y in zip(ort_kv_logits(tmp_path / "b.onnx", cfg, prompt, steps),
                    ort_kv_logits(tmp_path / "f.onnx", cfg, prompt, steps)):
        assert np.array_equal(x, y)
    got, want = (onnx.load(str(tmp_path / f"{n}.q4.onnx")) for n in "bf")
    got = {t.name: onnx.numpy_helper.to_array(t) for t in got.graph.initializer}
    want = {t.name: onnx.numpy_helper.to_array(t) for t in want.graph.initializer}
    assert set(got) == set(want) and all(np.array_equal(got[k], want[k]) for k in got)
    kept = [k for k in got if "down_proj" in k and got[k].dtype == np.float32 and got[k].ndim == 2]
    assert len(kept) == 2   # the float weights --keep-float kept, widened into the output


def test_weight_file_keeps_only_what_the_graph_reads(tmp_path):
    """A weight a pass wrote and a later pass dropped is not carried into the output's data file;
    small tensors stay in the message."""
    from onnx import helper

    from qwc.atomic import publish
    from qwc.passes.pipeline import stage_graph

    cfg = _hub_dir(tmp_path / "hf", "0.5b")
    rng = np.random.default_rng(0)
    kept, dropped = rng.standard_normal((64, 512)).astype(np.float32), rng.standard_normal((512, 64)).astype(np.float32)
    out = tmp_path / "g.onnx"
    stage = tmp_path / "stage"
    stage.mkdir()
    with weights_to(stage / "g.onnx.data") as wf:
        g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 512])])
        wf.add(dropped, "gone")
        g.initializer.extend([new_tensor(kept, "w"), new_tensor(np.ones(3, np.float32), "small")])
        assert g.initializer[0].data_location == onnx.TensorProto.EXTERNAL and g.initializer[1].raw_data
        model = helper.make_model(g)
        moves = stage_graph(model, out, stage, cfg, None, weights=wf)
    publish(moves)
    assert (tmp_path / "g.onnx.data").stat().st_size == kept.nbytes
    back = onnx.load(str(out))
    assert np.array_equal(onnx.numpy_helper.to_array(back.graph.initializer[0]), kept)


def test_auto_streams_large_checkpoints(tiny_lm, tmp_path, monkeypatch):
    src = tmp_path / "hf"
    tiny_lm.model.save_pretrained(src)
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    monkeypatch.setattr(load_mod, "STREAM_FROM_PARAMS", 1000)   # tiny counts as large
    assert main(["-q", "export", str(src), "-o", str(tmp_path / "a.onnx")]) == 0
    m = onnx.load(str(tmp_path / "a.onnx"), load_external_data=False)
    assert any(p.key == STREAM_EXPORT_KEY for p in m.metadata_props)


def _fails(argv, capsys, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in needles), err


def test_bad_input_to_the_streaming_path(tiny_lm, tmp_path, capsys):
    _fails(["-q", "export", "tiny", "-o", str(tmp_path / "t.onnx"), "--exporter", "stream"], capsys,
           "preset", "--exporter stream")
    src = tmp_path / "hf"
    tiny_lm.model.save_pretrained(src)
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    capsys.readouterr()   # transformers' shard-writing bar
    _fails(["-q", "compile", str(src), "-o", str(tmp_path / "x.qwc")], capsys, "checkpoint", "qwc export")
    out = tmp_path / "m.onnx"
    assert main(["-q", "export", str(src), "-o", str(out), "--exporter", "stream"]) == 0
    data = tmp_path / "m.onnx.data"
    keep = data.read_bytes()
    data.write_bytes(keep[: len(keep) // 2])
    _fails(["-q", "optimize", str(out), "-o", str(tmp_path / "q.onnx")], capsys, "past the end", "m.onnx.data")
    data.unlink()
    _fails(["-q", "optimize", str(out), "-o", str(tmp_path / "q.onnx")], capsys, "m.onnx.data", "missing")
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.slow
def test_stages_refuse_up_front_when_memory_is_short(tiny_lm, tiny_q4, tmp_path, capsys, monkeypatch):
    """Each stage estimates its peak and refuses in one line, naming the figures and what
    lowers the need, rather than being killed; --no-memory-check runs anyway."""
    from qwc import memory_check

    with pytest.raises(Exception, match=r"needs about 2\.0 GiB of memory and 1\.5 GiB is available; try X"):
        memory_check.check("it", 2 * 2**30, "try X", available=2**30, held=2**29)
    memory_check.check("it", 2 * 2**30, "try X", available=2**30, held=2**30)        # held counts
    memory_check.check("it", 2 * 2**30, "try X", available=2**30, skip=True)
    assert memory_check.available_bytes() > 0                                      # /proc/meminfo here

    src = tmp_path / "hf"
    tiny_lm.model.save_pretrained(src)
    tiny_lm.tokenizer.save(str(src / "tokenizer.json"))
    capsys.readouterr()
    monkeypatch.setattr(memory_check, "available_bytes", lambda: 2**20)   # 1 MiB left
    out = tmp_path / "out"
    out.mkdir()
    _fails(["-q", "export", str(src), "-o", str(out / "m.onnx"), "--exporter", "torch"], capsys,
           "the torch export needs about", "--exporter stream", "--no-memory-check")
    _fails(["-q", "export", str(src), "-o", str(out / "m.onnx"), "--exporter", "stream"], capsys,
           "the streaming export needs about")
    _fails(["-q", "optimize", str(tiny_q4.with_name("tiny.q4.onnx")), "-o", str(out / "q.onnx")], capsys,
           "running the passes needs about")
    _fails(["-q", "compile", str(tiny_q4), "-o", str(out / "m.qwc")], capsys, "compiling tiny.q4.onnx needs about")
    assert not any(out.iterdir())                                              # nothing half-written
    assert main(["-q", "export", str(src), "-o", str(out / "m.onnx"), "--no-memory-check"]) == 0


def test_the_export_refuses_a_graph_the_disk_cannot_hold(tmp_path, capsys, monkeypatch):
    """A 32B's float graph is 131 GB: refused before a byte is written, naming both figures;
    the estimate is a lower bound of what a streamed export writes."""
    from collections import namedtuple

    from qwc.models import stream_export
    from qwc.models.presets import preset_checkpoint

    out = tmp_path / "m.onnx"
    assert main(["-q", "export", "tiny-qwen3", "-o", str(out), "--exporter", "stream"]) == 0
    written = (tmp_path / "m.onnx.data").stat().st_size
    # the rest is the rotary caches, large beside a tiny model's weights
    assert 0.75 * written <= stream_export.stream_disk(preset_checkpoint("tiny-qwen3")) <= written

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(stream_export.shutil, "disk_usage", lambda p: usage(2**40, 2**40 - 10 * 2**30, 10 * 2**30))
    _fails(["-q", "export", "qwen2.5-32b", "-o", str(tmp_path / "big.onnx")], capsys,
           "big.onnx", "122.1 GiB of disk", "10.0 GiB is free")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m.onnx", "m.onnx.data", "m.config.json", "m.tokenizer.json"])
