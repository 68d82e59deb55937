"""A bad-input campaign against the `qwc` command line and the runtime's API.

Each case runs qwc in a subprocess in a folder of its own, on copies of a tiny model built once
(export -> optimize -> compile), and is classified by what a user would see:

    clean error       exit 2 (130 on Ctrl-C), one line `qwc: error: ...`, nothing half-written
    correct           exit 0 and the case's own check of the result passes
    traceback         a Python traceback on stderr
    crash             killed by a signal it was not sent, or an unexpected exit status
    hang              no exit within the case's time limit
    silent wrong      exit 0 but the result is wrong (e.g. logits read outside the embedding)
    accepted invalid  exit 0 on a value that should be refused
    leftovers         temp folders beside the output or in TMPDIR, a half-written output,
                      or a user's file changed or gone

Families: onnx (mutated graphs), artifact (corrupted model.qwc), options (hostile prompts,
flags and API calls), paths (existing outputs, full disk, concurrent writers, signals),
inputs (bad eval/export inputs).

    python tests/fuzz/campaign.py --cases 320 --seed 0 [--jobs 2] [--keep DIR] [--json out.json]

tests/fuzz/test_fuzz.py runs every named case and a seeded sample of the random ones.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

OUTCOMES = ("clean error", "correct", "traceback", "crash", "hang", "silent wrong", "accepted invalid",
            "leftovers")
BAD = OUTCOMES[2:]
FAMILIES = ("onnx", "artifact", "options", "paths", "inputs")
PROMPT = "Hello"


@dataclass
class Case:
    family: str
    name: str
    argv: list[str] | None = None            # qwc arguments (-q is added unless `progress`)
    api: str | None = None                   # or: Python run against the runtime's API
    expect: tuple[str, ...] = ("error",)     # "error", "ok", "interrupt"
    setup: Callable[[Path], None] | None = None
    check: Callable[[Path, "Run"], str | None] | None = None   # for exit 0: None if right
    stdin: bytes = b""
    output: str | None = None                # what the command writes (must not half-exist)
    signal_at: tuple[str, float, int] | None = None   # (stderr marker, delay s, signal)
    then: list[str] | None = None            # after a SIGKILL: rerun this, it must succeed
    concurrent: int = 1                      # identical commands started together
    timeout: float = 120.0
    needs_tmpfs: bool = False
    pipe_head: int | None = None             # stdout through `head -c N`
    env: dict = field(default_factory=dict)  # extra environment; "{cwd}" is the case folder


@dataclass
class Run:
    rc: int | None
    stdout: bytes
    stderr: str
    seconds: float


@dataclass
class Result:
    case: Case
    outcome: str
    detail: str = ""
    seconds: float = 0.0


# -- the model every case starts from --------------------------------------------------------

def qwc_cmd() -> list[str]:
    return [sys.executable, "-m", "qwc"]


def prepare(base: Path, onnx_src: Path | None = None) -> dict:
    """tiny.onnx (+ sidecars), tiny.q4.onnx, tiny.qwc and the reference greedy output."""
    base.mkdir(parents=True, exist_ok=True)
    q = qwc_cmd() + ["-q"]
    if (base / "reference.txt").is_file():   # --keep DIR: built by an earlier run
        return {"base": base, "reference": (base / "reference.txt").read_bytes()}
    if onnx_src is not None:
        from qwc.config import sidecar_paths
        for src in (Path(onnx_src), *sidecar_paths(onnx_src)):
            shutil.copy(src, base / src.name.replace(Path(onnx_src).stem, "tiny", 1))
    else:
        subprocess.run(q + ["export", "tiny", "-o", str(base / "tiny.onnx")], check=True)
    subprocess.run(q + ["optimize", str(base / "tiny.onnx"), "-o", str(base / "tiny.q4.onnx")], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(q + ["compile", str(base / "tiny.q4.onnx"), "-o", str(base / "tiny.qwc")], check=True)
    ref = subprocess.run(q + ["run", str(base / "tiny.qwc"), "--prompt", PROMPT, "--max-new-tokens", "8"],
                         check=True, capture_output=True).stdout
    (base / "reference.txt").write_bytes(ref)
    return {"base": base, "reference": ref}


# -- running one case ------------------------------------------------------------------------

def default_sigint() -> None:
    """preexec_fn: the case's process gets Ctrl-C as from a shell's foreground command, whatever
    the harness's process does with SIGINT (an ignored signal stays ignored across exec, and
    Python then installs no handler: the Ctrl-C cases would test nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(case: Case, cwd: Path, env: dict, argv: list[str]):
    if case.api is not None:
        code = _API_PRELUDE + "def _case():\n" + case.api + "\n_main()\nprint('OK')\n"
        cmd = [sys.executable, "-c", code]
    else:
        cmd = qwc_cmd() + ([] if case.signal_at else ["-q"]) + argv
    if case.pipe_head is not None:
        p1 = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, preexec_fn=default_sigint)
        head = subprocess.Popen(["head", "-c", str(case.pipe_head)], stdin=p1.stdout, stdout=subprocess.PIPE)
        p1.stdout.close()
        return p1, head
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=default_sigint), None


_API_PRELUDE = """
import sys
import numpy as np
from qwc.errors import QwcError
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams
def _main():
    try:
        _case()
    except QwcError as e:
        print(f"qwc: error: {e}", file=sys.stderr)
        sys.exit(2)
"""


def run_once(case: Case, cwd: Path, env: dict, argv: list[str] | None = None) -> Run:
    argv = case.argv if argv is None else argv
    t0 = time.perf_counter()
    proc, head = _start(case, cwd, env, argv)
    err_lines: list[str] = []

    def pump():
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace")
            err_lines.append(line)
            if case.signal_at and case.signal_at[0] is not None and case.signal_at[0] in line and not getattr(pump, "sent", False):
                pump.sent = True
                threading.Timer(case.signal_at[1], lambda: _signal(proc, case.signal_at[2])).start()

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    if case.signal_at and case.signal_at[0] is None:   # a time from the start, no marker
        threading.Timer(case.signal_at[1], lambda: _signal(proc, case.signal_at[2])).start()
    try:
        if case.stdin:
            proc.stdin.write(case.stdin)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out = b""
    try:
        if head is not None:
            out = head.communicate(timeout=case.timeout)[0]
        else:
            out = proc.stdout.read()
        rc = proc.wait(timeout=max(1.0, case.timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = None
    t.join(timeout=5)
    return Run(rc, out, "".join(err_lines), time.perf_counter() - t0)


def _signal(proc, sig):
    if proc.poll() is None:
        proc.send_signal(sig)


def _snapshot(root: Path) -> dict[str, bytes | None]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and "user" in p.name:
            out[str(p.relative_to(root))] = p.read_bytes()
    return out


def _temp_leftovers(root: Path, tmpdir: Path) -> list[str]:
    left = [str(p.relative_to(root)) for p in root.rglob(".*") if p.is_dir() and p.suffix in (".tmp", ".old")]
    left += [str(p.relative_to(root)) for p in root.rglob("*.part")]
    # torch makes its compile cache there on import (persistent by design, as ~/.cache)
    left += [f"TMPDIR/{p.name}" for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")]
    return left


def run_case(case: Case, model: dict, root: Path) -> Result:
    _MODEL.update(model)
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "_", f"{case.family}-{case.name}")[:120]
    cwd = root / slug
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    tmpdir = root / f"tmp-{slug}"
    shutil.rmtree(tmpdir, ignore_errors=True)
    tmpdir.mkdir()
    env = dict(os.environ, TMPDIR=str(tmpdir), QWC_FUZZ_BASE=str(model["base"]),
               **{k: v.replace("{cwd}", str(cwd)) for k, v in case.env.items()})
    env.pop("TVM_NUM_THREADS", None)
    mounted = False
    try:
        if case.needs_tmpfs:
            (cwd / "disk").mkdir()
            size = case.env.get("QWC_FUZZ_TMPFS", "256k")
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(cwd / "disk")],
                               capture_output=True, text=True)
            if r.returncode != 0:
                return Result(case, "crash", f"harness: cannot mount a small tmpfs ({r.stderr.strip()}); run as root")
            mounted = True
        if case.setup:
            try:
                case.setup(cwd)
            except Exception as e:   # the harness's own bug: report it, run the others
                return Result(case, "crash", f"harness: setup failed: {type(e).__name__}: {e}")
        before = _snapshot(cwd)
        output_existed = case.output is not None and (cwd / case.output).exists()
        if case.concurrent > 1:
            with ThreadPoolExecutor(case.concurrent) as ex:
                runs = list(ex.map(lambda _: run_once(case, cwd, env), range(case.concurrent)))
        else:
            runs = [run_once(case, cwd, env)]
        if case.then is not None:
            c2 = Case(case.family, case.name, argv=case.then, expect=("ok",))
            runs.append(run_once(c2, cwd, env))
        outcome, detail = classify(case, runs, model, cwd)
        if outcome in ("clean error", "correct"):
            left = _temp_leftovers(cwd, tmpdir)
            if (outcome == "clean error" and case.output is not None and not output_existed
                    and (cwd / case.output).exists()):
                left.append(f"half-written {case.output}")
            after = _snapshot(cwd)
            lost = [k for k, v in before.items() if after.get(k) != v]
            if lost:
                left.append(f"user file changed or gone: {lost[0]}")
            if left:
                outcome, detail = "leftovers", ", ".join(left[:3])
        return Result(case, outcome, detail, sum(r.seconds for r in runs))
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(cwd / "disk")], capture_output=True)
        shutil.rmtree(tmpdir, ignore_errors=True)


def classify(case: Case, runs: list[Run], model: dict, cwd: Path) -> tuple[str, str]:
    for r in runs:
        if r.rc is None:
            return "hang", f"no exit in {case.timeout:.0f}s"
        if "Traceback (most recent call last)" in r.stderr:
            return "traceback", _last(r.stderr)
    killed = case.signal_at is not None and case.signal_at[2] == signal.SIGKILL
    first = runs[0]
    if killed:
        if first.rc not in (-signal.SIGKILL, 0):
            return "crash", f"exit {first.rc} (expected the SIGKILL)"
        second = runs[1]
        if second.rc != 0:
            return "crash", f"rerun exit {second.rc}: {_last(second.stderr)}"
        why = case.check(cwd, second) if case.check else None
        return ("silent wrong", why) if why else ("correct", "")
    for r in runs:
        if r.rc is not None and r.rc < 0:
            return "crash", f"signal {-r.rc}"
    results = []
    for r in runs:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("[qwc]")]
        if r.rc in (2, 130):
            want = "qwc: interrupted" if r.rc == 130 else "qwc: error: "
            if len(lines) != 1 or not lines[0].startswith(want):
                return "traceback", f"exit {r.rc} without one clean line: {' | '.join(lines)[:200]}"
            if r.rc == 130 and "interrupt" not in case.expect:
                return "crash", "exit 130 without an interrupt"
            results.append("clean error")
        elif r.rc == 141 and case.pipe_head is not None:
            results.append("correct" if not lines else "traceback")
        elif r.rc == 0:
            if "error" in case.expect and "ok" not in case.expect:
                return "accepted invalid", f"exit 0; stderr {' | '.join(lines)[:120]}"
            if "interrupt" in case.expect and "ok" not in case.expect:
                return "accepted invalid", "exit 0 although interrupted"
            why = case.check(cwd, r) if case.check else None
            if why:
                return "silent wrong", why
            results.append("correct")
        else:
            return "crash", f"exit {r.rc}: {_last(r.stderr)}"
    if "clean error" in results and not ({"error", "interrupt"} & set(case.expect)):
        return "crash", f"refused a valid input: {_last(runs[0].stderr)}"
    return ("clean error" if "clean error" in results else "correct"), _last(runs[0].stderr)


def _last(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


# -- checks ----------------------------------------------------------------------------------

def same_as_reference(cwd: Path, r: Run) -> str | None:
    ref = _MODEL["reference"]
    return None if r.stdout == ref else f"output {r.stdout[:60]!r} differs from the clean artifact's {ref[:60]!r}"


def artifact_runs(path: str):
    def check(cwd: Path, r: Run) -> str | None:
        run = subprocess.run(qwc_cmd() + ["-q", "run", str(cwd / path), "--prompt", PROMPT,
                                          "--max-new-tokens", "8"], capture_output=True)
        if run.returncode != 0:
            return f"the artifact written does not run: {_last(run.stderr.decode())}"
        return None
    return check


def graph_loads(path: str):
    """The canonical graph runs in onnxruntime (which knows its com.microsoft ops)."""
    def check(cwd: Path, r: Run) -> str | None:
        import onnxruntime as ort
        try:
            ort.InferenceSession(str(cwd / path), providers=["CPUExecutionProvider"])
        except Exception as e:
            return f"the graph written does not load in onnxruntime: {str(e).splitlines()[0][:120]}"
        return None
    return check


def prints_something(cwd: Path, r: Run) -> str | None:
    return None if r.stdout.strip() else "exit 0 with no output"


_MODEL: dict = {}


# -- setup helpers ---------------------------------------------------------------------------

def _base() -> Path:
    return Path(os.environ.get("QWC_FUZZ_BASE") or _MODEL["base"])


def copy_graph(name: str = "tiny.onnx", as_name: str = "m.onnx"):
    """The exported (or canonical) graph and its sidecars, as `as_name` in the case folder."""
    def setup(cwd: Path):
        from qwc.config import sidecar_paths
        src = _base() / name
        dst = cwd / as_name
        shutil.copy(src, dst)
        for s, d in zip(sidecar_paths(src), sidecar_paths(dst)):
            shutil.copy(s, d)
    return setup


def copy_artifact(cwd: Path):
    shutil.copytree(_base() / "tiny.qwc", cwd / "a.qwc")


def both(*fns):
    def setup(cwd: Path):
        for f in fns:
            f(cwd)
    return setup


def user_file(rel: str, content: bytes = b"my notes\n"):
    def setup(cwd: Path):
        p = cwd / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
    return setup


def edit_manifest(fn):
    def setup(cwd: Path):
        copy_artifact(cwd)
        mf = cwd / "a.qwc" / "manifest.json"
        m = json.loads(mf.read_text())
        out = fn(m)
        mf.write_text(out if isinstance(out, str) else json.dumps(m))
    return setup


def replace_file(name: str, data: bytes, rehash: bool = True):
    """Replace an artifact file, updating its hash (a deliberate edit: the checks that remain)."""
    def setup(cwd: Path):
        import hashlib
        copy_artifact(cwd)
        (cwd / "a.qwc" / name).write_bytes(data)
        if rehash:
            mf = cwd / "a.qwc" / "manifest.json"
            m = json.loads(mf.read_text())
            m["files"][name] = hashlib.sha256(data).hexdigest()
            mf.write_text(json.dumps(m))
    return setup


def edit_graph(fn, name: str = "tiny.onnx"):
    """Copy the graph, apply `fn(model)` with onnx, save (small: inline weights)."""
    def setup(cwd: Path):
        import onnx
        copy_graph(name)(cwd)
        m = onnx.load(str(cwd / "m.onnx"))
        fn(m)
        onnx.save(m, str(cwd / "m.onnx"))
    return setup


def edit_bytes(fn, name: str = "tiny.onnx"):
    def setup(cwd: Path):
        copy_graph(name)(cwd)
        p = cwd / "m.onnx"
        p.write_bytes(fn(bytearray(p.read_bytes())))
    return setup


def edit_config(fn, name: str = "tiny.onnx"):
    def setup(cwd: Path):
        copy_graph(name)(cwd)
        p = cwd / "m.config.json"
        d = json.loads(p.read_text())
        out = fn(d)
        p.write_text(out if isinstance(out, str) else json.dumps(d))
    return setup


def _hf_dir_layers(config_layers: int, weight_layers: int, layer_types: bool):
    """hf/: a Qwen2 directory whose config.json says `config_layers` layers while its weights
    hold `weight_layers` (`layer_types`: the per-layer list transformers writes, as long as the
    weights)."""
    def setup(cwd: Path):
        import numpy as np
        from safetensors.numpy import save_file

        from qwc.config import ModelConfig
        from qwc.models.checkpoint import expected_tensors
        from qwc.models.tokenizer import byte_level_tokenizer

        hf = {"model_type": "qwen2", "vocab_size": 288, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": weight_layers, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True}
        cfg = ModelConfig.from_hf_dict(hf, name="hf", source="fuzz")
        (cwd / "hf").mkdir()
        rng = np.random.default_rng(0)
        save_file({n: (0.02 * rng.standard_normal(shape)).astype(np.float32)
                   for n, shape in expected_tensors(cfg).items()}, str(cwd / "hf" / "model.safetensors"))
        hf["num_hidden_layers"] = config_layers
        if layer_types:
            hf["layer_types"] = ["full_attention"] * weight_layers
        (cwd / "hf" / "config.json").write_text(json.dumps(hf))
        byte_level_tokenizer().save(str(cwd / "hf" / "tokenizer.json"))
    return setup


# -- the cases -------------------------------------------------------------------------------

def _set(d, path, value):
    keys = path.split("/")
    for k in keys[:-1]:
        d = d[int(k)] if isinstance(d, list) else d[k]
    last = keys[-1]
    if isinstance(d, list):
        d[int(last)] = value
    elif value is _DELETE:
        del d[last]
    else:
        d[last] = value
    return d


_DELETE = object()


def named_cases() -> list[Case]:
    """Every case the reliability issue lists, by name, plus the ones that complete the families."""
    art = ["run", "a.qwc", "--prompt", PROMPT, "--max-new-tokens", "8"]
    return [c for family in (_onnx_cases, _artifact_cases, _options_cases, _paths_cases, _inputs_cases)
            for c in family(art)]


def _onnx_cases(art: list[str]) -> list[Case]:
    """The onnx family: mutated graphs into compile and optimize."""
    C = []
    def fp16(m):
        import numpy as np
        from onnx import numpy_helper
        for i, t in enumerate(m.graph.initializer):
            a = numpy_helper.to_array(t)
            if a.dtype == np.float32:
                with np.errstate(over="ignore"):   # the mask's -3.4e38 becomes -inf: fine here
                    m.graph.initializer[i].CopyFrom(numpy_helper.from_array(a.astype(np.float16), t.name))

    def drop_node(kind):
        def f(m):
            idx = next(i for i, n in enumerate(m.graph.node) if n.op_type == kind)
            del m.graph.node[idx]
        return f

    def rename_op(kind, new, domain=""):
        def f(m):
            n = next(n for n in m.graph.node if n.op_type == kind)
            n.op_type, n.domain = new, domain
        return f

    def rename_output(m):
        m.graph.output[0].name = "not_logits"

    def float_input_ids(m):
        import onnx
        next(i for i in m.graph.input if i.name == "input_ids").type.tensor_type.elem_type = onnx.TensorProto.FLOAT

    def foreign_graph(cwd: Path):
        import onnx
        from onnx import TensorProto, helper
        g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        onnx.save(helper.make_model(g), str(cwd / "m.onnx"))
        shutil.copy(_base() / "tiny.config.json", cwd / "m.config.json")

    def external_missing(cwd: Path):
        import onnx
        copy_graph()(cwd)
        m = onnx.load(str(cwd / "m.onnx"))
        onnx.save(m, str(cwd / "m.onnx"), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
        (cwd / "m.onnx.data").unlink()

    for cmd, out in (("compile", "out.qwc"), ("optimize", "out.onnx")):
        A = [cmd, "m.onnx", "-o", out]
        C += [
            Case("onnx", f"{cmd}-float16-weights", A, setup=edit_graph(fp16), output=out),
            Case("onnx", f"{cmd}-truncated", A, setup=edit_bytes(lambda b: b[:len(b) // 2]), output=out),
            Case("onnx", f"{cmd}-empty-file", A, setup=edit_bytes(lambda b: b""), output=out),
            Case("onnx", f"{cmd}-text-file", A, setup=edit_bytes(lambda b: b"hello world\n" * 10), output=out),
            Case("onnx", f"{cmd}-foreign-graph", A, setup=foreign_graph, output=out),
            Case("onnx", f"{cmd}-removed-matmul", A, setup=edit_graph(drop_node("MatMul")), output=out),
            Case("onnx", f"{cmd}-unsupported-op", A, setup=edit_graph(rename_op("MatMul", "Conv")), output=out),
            Case("onnx", f"{cmd}-custom-op", A, setup=edit_graph(rename_op("MatMul", "FusedThing", "com.example")),
                 output=out),
            Case("onnx", f"{cmd}-no-logits-output", A, setup=edit_graph(rename_output), output=out),
            Case("onnx", f"{cmd}-float-input-ids", A, setup=edit_graph(float_input_ids), output=out),
            Case("onnx", f"{cmd}-missing-external-data", A, setup=external_missing, output=out),
            Case("onnx", f"{cmd}-missing-input", A, setup=lambda cwd: None, output=out),
            Case("onnx", f"{cmd}-no-config", A, setup=both(copy_graph(), lambda c: (c / "m.config.json").unlink()),
                 output=out),
            Case("onnx", f"{cmd}-config-not-json", A, setup=edit_config(lambda d: "{nope"), output=out),
            Case("onnx", f"{cmd}-config-head-dim-0", A, setup=edit_config(lambda d: _set(d, "head_dim", 0)),
                 output=out),
            Case("onnx", f"{cmd}-config-string-layers", A,
                 setup=edit_config(lambda d: _set(d, "num_hidden_layers", "two")), output=out),
        ]
    C.append(Case("onnx", "compile-unknown-target", ["compile", "m.onnx", "--target", "riscv", "-o", "o.qwc"],
                  setup=copy_graph(), output="o.qwc"))

    def hf_config(**over):
        def setup(cwd: Path):
            shutil.copy(_base() / "tiny.onnx", cwd / "m.onnx")
            d = {"model_type": "qwen2", "vocab_size": 288, "hidden_size": 128, "intermediate_size": 320,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
            d.update(over)
            (cwd / "config.json").write_text(json.dumps(d))
        return setup

    for key, bad in (("num_attention_heads", 0), ("hidden_size", -128), ("vocab_size", "288"),
                     ("rope_theta", "fast"), ("num_key_value_heads", 3), ("rms_norm_eps", -1)):
        C.append(Case("inputs", f"hf-config-{key}-{bad}", ["compile", "m.onnx", "-o", "o.qwc"],
                      setup=hf_config(**{key: bad}), output="o.qwc"))
    return C


def _artifact_cases(art: list[str]) -> list[Case]:
    """The artifact family: manifest fields and files."""
    C = []
    edits = {
        "layers-3": lambda m: _set(m, "model/num_hidden_layers", 3),
        "head-dim-0": lambda m: _set(m, "model/head_dim", 0),
        "params-missing": lambda m: m["params"].pop(5),
        "params-reordered": lambda m: m["params"].insert(0, m["params"].pop(3)),
        "offset-negative": lambda m: _set(m, "params/2/offset", -64),
        "offset-string": lambda m: _set(m, "params/2/offset", "64"),
        "offset-past-end": lambda m: _set(m, "params/-1/offset", 1 << 40),
        "dtype-bad": lambda m: _set(m, "params/0/dtype", "complex128"),
        "shape-changed": lambda m: _set(m, "params/0/shape", [64, 2]),
        "multiple-zero": lambda m: _set(m, "functions/cache_capacity_multiple", 0),
        "vocab-larger": lambda m: _set(m, "model/vocab_size", 100000),
        "vocab-smaller": lambda m: _set(m, "model/vocab_size", 100),
        "eos-out-of-vocab": lambda m: _set(m, "model/eos_token_ids", [10 ** 9]),
        "kv-heads-changed": lambda m: _set(m, "model/num_key_value_heads", 4),
        "cache-shape-changed": lambda m: _set(m, "functions/cache_shape", ["1", 2, "ctx", 64]),
        "format-version-3": lambda m: _set(m, "format_version", 3),
        "at-rest-unknown-form": lambda m: (_set(m, "format_version", 2), _set(m, "params/0/at_rest", {"form": "zstd"})),
        "at-rest-in-version-1": lambda m: _set(m, "params/0/at_rest", {"form": "six_bit"}),
        "target-arch-arm": lambda m: _set(m, "target/arch", "aarch64"),
        "feature-missing-here": lambda m: m["target"]["features"].append("sme2"),
        "files-path-traversal": lambda m: _set(m, "files", {**m["files"], "../../etc/passwd": "0" * 64}),
        "hash-not-hex": lambda m: _set(m, "files/lib.so", "xyz"),
        "files-not-dict": lambda m: _set(m, "files", ["lib.so"]),
        "no-model": lambda m: _set(m, "model", _DELETE),
        "model-null": lambda m: _set(m, "model", None),
        "params-null": lambda m: _set(m, "params", None),
        "not-json": lambda m: "{",
        "json-array": lambda m: "[]",
        "empty": lambda m: "",
        "max-positions-zero": lambda m: _set(m, "model/max_position_embeddings", 0),
        "rope-theta-string": lambda m: _set(m, "model/rope_theta", "x"),
    }
    for name, fn in edits.items():
        C.append(Case("artifact", f"manifest-{name}", art, setup=edit_manifest(fn)))
    C += [
        Case("artifact", "lib-so-garbage", art, setup=replace_file("lib.so", b"\x7fELF" + b"\0" * 300)),
        Case("artifact", "lib-so-text", art, setup=replace_file("lib.so", b"not a library\n")),
        Case("artifact", "tokenizer-invalid", art, setup=replace_file("tokenizer.json", b"{\"version\": 1}")),
        Case("artifact", "tokenizer-binary", art, setup=replace_file("tokenizer.json", b"\xff\xfe\x00garbage")),
        Case("artifact", "params-truncated", art,
             setup=lambda c: (copy_artifact(c), _truncate(c / "a.qwc" / "params.bin"))),
        Case("artifact", "params-bitflip", art,
             setup=lambda c: (copy_artifact(c), _flip(c / "a.qwc" / "params.bin", 1000))),
        Case("artifact", "lib-missing", art, setup=lambda c: (copy_artifact(c), (c / "a.qwc" / "lib.so").unlink())),
        Case("artifact", "manifest-missing", art,
             setup=lambda c: (copy_artifact(c), (c / "a.qwc" / "manifest.json").unlink())),
        Case("artifact", "path-is-file", art, setup=user_file("a.qwc")),
        Case("artifact", "path-missing", art),
        Case("artifact", "bench-on-corrupt", ["bench", "a.qwc", "-p", "8", "-n", "4", "-r", "1"],
             setup=edit_manifest(lambda m: _set(m, "params/0/dtype", "int128"))),
        Case("artifact", "eval-on-corrupt", ["eval", "a.qwc", "--ppl", "t.txt"],
             setup=both(edit_manifest(lambda m: _set(m, "model/head_dim", -2)), _text_file)),
    ]
    return C


def _options_cases(art: list[str]) -> list[Case]:
    """The options family: prompts, flags and API calls."""
    C = []
    def run_args(*extra, prompt=PROMPT):
        return ["run", "a.qwc", "--prompt", prompt, "--max-new-tokens", "4", *extra]

    bad_flags = [("--temperature", "nan"), ("--temperature", "-1"), ("--temperature", "inf"),
                 ("--top-p", "2"), ("--top-p", "-0.5"), ("--top-p", "nan"), ("--top-p", "0"),
                 ("--top-k", "-3"), ("--repetition-penalty", "0"), ("--repetition-penalty", "-1"),
                 ("--threads", "0"), ("--threads", "-1"), ("--threads", "1000"), ("--threads", "two"),
                 ("--seed", "-2"), ("--seed", str(2 ** 64)), ("--ctx", "0"), ("--ctx", "-5"),
                 ("--ctx", "100000"), ("--max-new-tokens", "-1"), ("--temperature", "1e999")]
    for flag, value in bad_flags:
        C.append(Case("options", f"run{flag}={value}", run_args(flag, value), setup=copy_artifact))
    good = [("--seed", "-1"), ("--temperature", "0"), ("--top-p", "1"), ("--top-k", "0"), ("--threads", "1"),
            ("--max-new-tokens", "0"), ("--repetition-penalty", "1.3")]
    for flag, value in good:
        C.append(Case("options", f"run{flag}={value}-accepted", run_args(flag, value, "--temperature", "0.8")
                      if flag != "--temperature" else run_args(flag, value), setup=copy_artifact, expect=("ok",)))
    C += [
        Case("options", "run-greedy-matches-reference", art, setup=copy_artifact, expect=("ok",),
             check=same_as_reference),
        Case("options", "prompt-invalid-utf8", ["run", "a.qwc", "--prompt", "\udcff\udcfe"], setup=copy_artifact),
        Case("options", "prompt-empty", run_args(prompt=""), setup=copy_artifact),
        Case("options", "prompt-over-context", run_args("--ctx", "16", prompt="word " * 200), setup=copy_artifact),
        Case("options", "prompt-nul-and-controls", run_args(prompt="a\x01\x02\x1b[31m b"), setup=copy_artifact,
             expect=("ok",), check=prints_something),
        Case("options", "prompt-emoji-cjk", run_args(prompt="日本語 🙂 é"), setup=copy_artifact, expect=("ok",),
             check=prints_something),
        Case("options", "chat-stdin-invalid-utf8", ["run", "a.qwc", "--chat", "--max-new-tokens", "4"],
             setup=copy_artifact, stdin=b"\xff\xfe hello\n"),
        Case("options", "chat-stdin-ok", ["run", "a.qwc", "--chat", "--max-new-tokens", "4"], setup=copy_artifact,
             stdin=b"hi\n\nthere\n", expect=("ok",), check=prints_something),
        Case("options", "run-no-prompt", ["run", "a.qwc"], setup=copy_artifact),
        Case("options", "chat-template-broken", ["run", "a.qwc", "--chat"], stdin=b"hi\n",
             setup=edit_manifest(lambda m: _set(m, "model/chat_template", "{% for x in %}"))),
        Case("options", "chat-template-missing", ["run", "a.qwc", "--chat"], stdin=b"hi\n",
             setup=edit_manifest(lambda m: _set(m, "model/chat_template", None))),
        Case("options", "run-pipe-to-head", ["run", "a.qwc", "--prompt", PROMPT, "--max-new-tokens", "64"],
             setup=copy_artifact, expect=("ok",), pipe_head=3),
        Case("options", "bench-p-negative", ["bench", "a.qwc", "-p", "-1"], setup=copy_artifact),
        Case("options", "bench-n-negative", ["bench", "a.qwc", "-p", "4", "-n", "-5"], setup=copy_artifact),
        Case("options", "bench-r-zero", ["bench", "a.qwc", "-r", "0"], setup=copy_artifact),
        Case("options", "bench-nothing", ["bench", "a.qwc", "-p", "0", "-n", "0"], setup=copy_artifact),
        Case("options", "bench-p-over-positions", ["bench", "a.qwc", "-p", "5000", "-n", "0", "-r", "1"],
             setup=copy_artifact),
        Case("options", "unknown-flag", ["run", "a.qwc", "--frobnicate"], setup=copy_artifact),
        Case("options", "unknown-command", ["frobnicate"]),
        Case("options", "optimize-block-size-64", ["optimize", "m.onnx", "-o", "o.onnx", "--block-size", "64"],
             setup=copy_graph(), output="o.onnx"),
        Case("options", "tune-trials-zero", ["tune", "m.onnx", "--db", "db", "--trials", "0"], setup=copy_graph(),
             output="db"),
        Case("options", "qat-steps-zero", ["qat", "tiny", "--data", "t.txt", "--steps", "0", "-o", "q"],
             setup=_text_file, output="q"),
        Case("options", "qat-lr-inf", ["qat", "tiny", "--data", "t.txt", "--steps", "1", "--lr", "inf", "-o", "q"],
             setup=_text_file, output="q"),
        Case("options", "data-choices-options-1", ["data", "choices", "--text", "t.txt", "--options", "1",
                                                    "-o", "c.jsonl"], setup=_text_file, output="c.jsonl"),
        Case("options", "eval-chunks-zero", ["eval", "a.qwc", "--ppl", "t.txt", "--chunks", "0"],
             setup=both(copy_artifact, _text_file)),
        Case("options", "eval-chunks-negative", ["eval", "a.qwc", "--ppl", "t.txt", "--chunks", "-1"],
             setup=both(copy_artifact, _text_file)),
        Case("options", "eval-ctx-odd", ["eval", "a.qwc", "--ppl", "t.txt", "--ctx", "33"],
             setup=both(copy_artifact, _text_file)),
    ]
    api = {
        "prefill-minus-1": "e.prefill([-1])",
        "prefill-vocab": "e.prefill([e.vocab_size])",
        "prefill-2**31": "e.prefill([2**31])",
        "prefill-2**40": "e.prefill([2**40])",
        "prefill-2**70": "e.prefill([2**70])",
        "prefill-float": "e.prefill([1.5, 2.0])",
        "prefill-2d": "e.prefill([[1, 2], [3, 4]])",
        "prefill-none": "e.prefill(None)",
        "prefill-none-item": "e.prefill([1, None])",
        "prefill-string": "e.prefill('hello')",
        "prefill-empty": "e.prefill([])",
        "prefill-bool": "e.prefill([True])",
        "decode-minus-1": "e.prefill([1]); e.decode(-1)",
        "decode-10**6": "e.prefill([1]); e.decode(10**6)",
        "decode-float": "e.prefill([1]); e.decode(1.0)",
        "decode-list": "e.prefill([1]); e.decode([1])",
        "generate-bad-id": "list(e.generate([1, -7], max_new_tokens=2))",
        "generate-negative-max": "list(e.generate('hi', max_new_tokens=-1))",
        "score-out-of-vocab": "e.score([1, 99999])",
        "verify-out-of-vocab": "e.verify([1, 99999])",
        "verify-over-context": "Engine(A, ctx=8).verify(list(range(20)))",
        "threads-0": "Engine(A, threads=0)",
        "threads-1000": "Engine(A, threads=1000)",
        "ctx-0": "Engine(A, ctx=0)",
        "sampling-temperature-nan": "SamplingParams(temperature=float('nan'))",
        "sampling-top-p-2": "SamplingParams(top_p=2)",
        "sampling-top-k-negative": "SamplingParams(top_k=-3)",
        "sampling-penalty-0": "SamplingParams(repetition_penalty=0)",
        "sampling-seed-negative": "SamplingParams(seed=-1)",
        "encode-surrogates": "e.encode('\\udcff')",
        "prefill-over-context": "Engine(A, ctx=8).prefill(list(range(9)))",
    }
    for name, code in api.items():
        needs_engine = "e." in code
        body = ("    A = 'a.qwc'\n" + ("    e = Engine(A)\n" if needs_engine else "") + f"    {code}\n")
        C.append(Case("options", f"api-{name}", api=body, setup=copy_artifact))
    C.append(Case("options", "api-valid-calls", api="    A = 'a.qwc'\n    e = Engine(A, threads=1)\n"
                  "    l = e.prefill(np.array([1, 2, 3], np.int32)); e.decode(np.int64(4)); e.decode(int(l.argmax()))\n"
                  "    assert len(list(e.generate([5, 6], max_new_tokens=3))) >= 0\n",
                  setup=copy_artifact, expect=("ok",)))
    return C


def _paths_cases(art: list[str]) -> list[Case]:
    """The paths family: outputs that exist, full disk, concurrent writers, signals."""
    C = []
    C += [
        Case("paths", "compile-into-user-dir", ["compile", "m.onnx", "-o", "out"],
             setup=both(copy_graph(), user_file("out/user-notes.txt"))),
        Case("paths", "compile-user-file-in-artifact", ["compile", "m.onnx", "-o", "a.qwc"],
             setup=both(copy_graph(), copy_artifact, user_file("a.qwc/user-notes.txt"))),
        Case("paths", "compile-onto-user-file", ["compile", "m.onnx", "-o", "user-file"],
             setup=both(copy_graph(), user_file("user-file"))),
        Case("paths", "compile-replaces-own-artifact", ["compile", "m.onnx", "-o", "a.qwc"],
             setup=both(copy_graph(), copy_artifact), expect=("ok",), check=artifact_runs("a.qwc")),
        Case("paths", "compile-parent-is-file", ["compile", "m.onnx", "-o", "user-file/x.qwc"],
             setup=both(copy_graph(), user_file("user-file"))),
        Case("paths", "export-onto-user-onnx", ["export", "tiny", "-o", "user.onnx"], setup=user_file("user.onnx")),
        Case("paths", "export-onto-user-sidecar", ["export", "tiny", "-o", "m.onnx"],
             setup=user_file("m.tokenizer.json", b"user data, kept as m.tokenizer.json")),
        Case("paths", "export-not-onnx-suffix", ["export", "tiny", "-o", "m.txt"], output="m.txt"),
        Case("paths", "export-into-dir", ["export", "tiny", "-o", "d"], setup=user_file("d/user.txt")),
        Case("paths", "optimize-onto-user-onnx", ["optimize", "m.onnx", "-o", "user.onnx"],
             setup=both(copy_graph(), user_file("user.onnx"))),
        Case("paths", "optimize-in-place", ["optimize", "m.onnx", "-o", "m.onnx"], setup=copy_graph(),
             expect=("ok",), check=graph_loads("m.onnx")),
        Case("paths", "qat-into-user-dir", ["qat", "tiny", "--data", "t.txt", "--steps", "1", "--seq-len", "16",
                                            "--batch", "1", "-o", "q"],
             setup=both(_text_file, user_file("q/user.txt"))),
        Case("paths", "qat-user-ckpt-dir", ["qat", "tiny", "--data", "t.txt", "--steps", "1", "--seq-len", "16",
                                            "--batch", "1", "-o", "q"],
             setup=both(_text_file, user_file("q.ckpt/user.txt")), output="q"),
        Case("paths", "tune-db-user-dir", ["tune", "m.onnx", "--db", "db", "--trials", "1"],
             setup=both(copy_graph(), user_file("db/user.txt"))),
        Case("paths", "tune-db-is-file", ["tune", "m.onnx", "--db", "user-db", "--trials", "1"],
             setup=both(copy_graph(), user_file("user-db"))),
        Case("paths", "data-choices-onto-user-file", ["data", "choices", "--text", "t.txt", "-o", "user.jsonl"],
             setup=both(_text_file, user_file("user.jsonl"))),
        Case("paths", "data-fetch-user-file-in-cache", ["data", "fetch"], env={"QWC_DATA_DIR": "{cwd}/cache"},
             setup=both(user_file("cache/austen/user.txt"),   # a stand-in GGUF: nothing is downloaded
                        lambda c: (c / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")),
             timeout=60),
        Case("paths", "compile-full-disk", ["compile", "m.onnx", "-o", "disk/o.qwc"], setup=copy_graph(),
             needs_tmpfs=True, output="disk/o.qwc"),
        Case("paths", "optimize-full-disk", ["optimize", "m.onnx", "-o", "disk/o.onnx"], setup=copy_graph(),
             needs_tmpfs=True, output="disk/o.onnx"),
        Case("paths", "export-full-disk", ["export", "tiny", "-o", "disk/o.onnx"], needs_tmpfs=True,
             output="disk/o.onnx"),
        Case("paths", "choices-full-disk", ["data", "choices", "--text", "t.txt", "--items", "50",
                                            "-o", "disk/c.jsonl"], setup=both(_text_file, _fill_disk),
             needs_tmpfs=True, output="disk/c.jsonl"),
        Case("paths", "qat-full-disk", ["qat", "tiny", "--data", "t.txt", "--steps", "1", "--seq-len", "16",
                                        "--batch", "1", "-o", "disk/q"], setup=both(_text_file, _fill_disk),
             needs_tmpfs=True, output="disk/q"),
        Case("paths", "compile-full-disk-after-params", ["compile", "m.onnx", "-o", "disk/o.qwc"],
             setup=copy_graph(), needs_tmpfs=True, output="disk/o.qwc", env={"QWC_FUZZ_TMPFS": "2m"}),
        Case("paths", "compile-concurrent-writers", ["compile", "m.onnx", "-o", "o.qwc"], setup=copy_graph(),
             concurrent=2, expect=("ok", "error"), check=artifact_runs("o.qwc")),
        Case("paths", "sigint-compile-in-passes", ["compile", "m.onnx", "-o", "o.qwc"], setup=copy_graph(),
             signal_at=("running passes", 0.2, signal.SIGINT), expect=("interrupt",), output="o.qwc"),
    ]
    C += [Case("paths", f"sigint-compile-in-import-{t}s", ["compile", "m.q4.onnx", "-o", "o.qwc"],
               setup=copy_graph("tiny.q4.onnx", "m.q4.onnx"),
               signal_at=("importing into TVM", t, signal.SIGINT), expect=("interrupt",), output="o.qwc")
          for t in (0.3, 0.9, 1.5)]
    C += [
        Case("paths", "sigint-compile-in-build", ["compile", "m.q4.onnx", "-o", "o.qwc"],
             setup=copy_graph("tiny.q4.onnx", "m.q4.onnx"),
             signal_at=("building for", 1.5, signal.SIGINT), expect=("interrupt",), output="o.qwc"),
        Case("paths", "sigint-compile-in-write", ["compile", "m.q4.onnx", "-o", "o.qwc"],
             setup=copy_graph("tiny.q4.onnx", "m.q4.onnx"),
             signal_at=("writing", 0.2, signal.SIGINT), expect=("interrupt", "ok"), output="o.qwc",
             check=artifact_runs("o.qwc")),   # "ok": the Ctrl-C came once the artifact was in place
        Case("paths", "sigint-export", ["export", "tiny", "-o", "o.onnx"],
             signal_at=("tracing", 2.0, signal.SIGINT), expect=("interrupt",), output="o.onnx"),
        Case("paths", "sigint-optimize", ["optimize", "m.onnx", "-o", "o.onnx"], setup=copy_graph(),
             signal_at=("running passes", 0.1, signal.SIGINT), expect=("interrupt", "ok"), output="o.onnx"),
        Case("paths", "sigint-bench", ["bench", "a.qwc", "-p", "0", "-n", "2000", "-r", "200"], setup=copy_artifact,
             signal_at=(None, 3.0, signal.SIGINT), expect=("interrupt",)),
        Case("paths", "sigkill-compile-in-write-then-rerun", ["compile", "m.q4.onnx", "-o", "o.qwc"],
             setup=copy_graph("tiny.q4.onnx", "m.q4.onnx"), signal_at=("writing", 0.3, signal.SIGKILL),
             then=["compile", "m.q4.onnx", "-o", "o.qwc"], expect=("ok",), check=artifact_runs("o.qwc")),
        Case("paths", "sigkill-export-then-rerun", ["export", "tiny", "-o", "o.onnx"],
             signal_at=("tracing", 2.0, signal.SIGKILL), then=["export", "tiny", "-o", "o.onnx"], expect=("ok",)),
    ]
    return C


def _inputs_cases(art: list[str]) -> list[Case]:
    """The inputs family: eval and export."""
    C = []
    C += [
        Case("inputs", "eval-ppl-binary", ["eval", "a.qwc", "--ppl", "bin.txt"],
             setup=both(copy_artifact, user_file("bin.txt", bytes(range(256)) * 8))),
        Case("inputs", "eval-ppl-missing", ["eval", "a.qwc", "--ppl", "nope.txt"], setup=copy_artifact),
        Case("inputs", "eval-ppl-empty", ["eval", "a.qwc", "--ppl", "e.txt"],
             setup=both(copy_artifact, user_file("e.txt", b""))),
        Case("inputs", "eval-ppl-too-short", ["eval", "a.qwc", "--ppl", "s.txt"],
             setup=both(copy_artifact, user_file("s.txt", b"short text"))),
        Case("inputs", "eval-ppl-nul-bytes", ["eval", "a.qwc", "--ppl", "n.txt"],
             setup=both(copy_artifact, user_file("n.txt", b"text\0" * 500))),
        Case("inputs", "eval-choices-not-json", ["eval", "a.qwc", "--choices", "c.jsonl"],
             setup=both(copy_artifact, user_file("c.jsonl", b"{nope\n"))),
        Case("inputs", "eval-choices-answer-out-of-range", ["eval", "a.qwc", "--choices", "c.jsonl"],
             setup=both(copy_artifact, user_file("c.jsonl", b'{"context": "a", "options": ["b", "c"], "answer": 5}\n'))),
        Case("inputs", "eval-choices-binary", ["eval", "a.qwc", "--choices", "c.jsonl"],
             setup=both(copy_artifact, user_file("c.jsonl", b"\xff\xfe\x00\x01"))),
        Case("inputs", "eval-choices-empty-context", ["eval", "a.qwc", "--choices", "c.jsonl"],
             setup=both(copy_artifact, user_file("c.jsonl", b'{"context": "", "options": ["b", "c"], "answer": 0}\n'))),
        Case("inputs", "eval-nothing-to-do", ["eval", "a.qwc"], setup=copy_artifact),
        Case("inputs", "eval-ppl-ok", ["eval", "a.qwc", "--ppl", "t.txt", "--ctx", "64", "--chunks", "2"],
             setup=both(copy_artifact, _text_file), expect=("ok",), check=prints_something),
        Case("inputs", "eval-onnx-missing", ["eval", "nope.onnx", "--ppl", "t.txt"], setup=_text_file),
        Case("inputs", "export-missing-source", ["export", "nope-dir", "-o", "o.onnx"], output="o.onnx"),
        Case("inputs", "export-unknown-preset", ["export", "qwen9", "-o", "o.onnx"], output="o.onnx"),
        Case("inputs", "export-gguf-truncated", ["export", "g.gguf", "-o", "o.onnx"],
             setup=user_file("g.gguf", b"GGUF\x03\x00\x00\x00" + b"\0" * 20), output="o.onnx"),
        Case("inputs", "export-gguf-garbage", ["export", "g.gguf", "-o", "o.onnx"],
             setup=user_file("g.gguf", os.urandom(0) + b"garbage" * 100), output="o.onnx"),
        Case("inputs", "export-hf-dir-no-config", ["export", "hf", "-o", "o.onnx"],
             setup=user_file("hf/user.txt"), output="o.onnx"),
        Case("inputs", "export-hf-config-heads-0", ["export", "hf", "-o", "o.onnx"],
             setup=user_file("hf/config.json", json.dumps({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
                                                          "intermediate_size": 8, "num_hidden_layers": 1,
                                                          "num_attention_heads": 0}).encode()), output="o.onnx"),
        Case("inputs", "export-hf-config-list", ["export", "hf", "-o", "o.onnx"],
             setup=user_file("hf/config.json", b"[1, 2]"), output="o.onnx"),
        Case("inputs", "export-hf-bad-safetensors", ["export", "hf", "-o", "o.onnx"],
             setup=both(user_file("hf/config.json", json.dumps(
                 {"model_type": "qwen2", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}).encode()),
                 user_file("hf/model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")), output="o.onnx"),
        Case("inputs", "export-hf-config-more-layers-than-weights", ["export", "hf", "-o", "o.onnx"],
             setup=_hf_dir_layers(config_layers=2, weight_layers=1, layer_types=True), output="o.onnx"),
        Case("inputs", "export-hf-weights-lack-a-layer", ["export", "hf", "-o", "o.onnx"],
             setup=_hf_dir_layers(config_layers=2, weight_layers=1, layer_types=False), output="o.onnx"),
        Case("inputs", "data-unknown-action", ["data", "frobnicate"]),
        Case("inputs", "data-choices-binary-text", ["data", "choices", "--text", "b.txt", "-o", "c.jsonl"],
             setup=user_file("b.txt", bytes(range(256)) * 4), output="c.jsonl"),
        Case("inputs", "data-choices-unknown-novel", ["data", "choices", "--text", "austen:ulysses",
                                                       "-o", "c.jsonl"], output="c.jsonl"),
    ]
    return C


def _text_file(cwd: Path):
    """Plain English-like prose: ~600 sentences of 6-14 words."""
    words = "fox dog river house garden letter morning sister walk saw found kept near under".split()
    rng = random.Random(1)
    sents = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))).capitalize() + "."
             for _ in range(600)]
    (cwd / "t.txt").write_text(" ".join(sents) + "\n")


def _fill_disk(cwd: Path):
    """Leave the case's small tmpfs (disk/) with a few KiB free."""
    free = shutil.disk_usage(cwd / "disk").free
    (cwd / "disk" / "filler").write_bytes(b"\0" * max(0, free - 8192))


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])


def _flip(p: Path, at: int):
    b = bytearray(p.read_bytes())
    b[at % len(b)] ^= 0xFF
    p.write_bytes(bytes(b))


def random_cases(n: int, seed: int) -> list[Case]:
    """Seeded mutations: byte truncations and flips of graphs and artifacts, random manifest
    values, random option values."""
    rng = random.Random(seed)
    out = []
    art = ["run", "a.qwc", "--prompt", PROMPT, "--max-new-tokens", "8"]
    manifest_paths = ["format_version", "model/vocab_size", "model/hidden_size", "model/num_hidden_layers",
                      "model/head_dim", "model/num_key_value_heads", "model/eos_token_ids", "model/bos_token_id",
                      "model/max_position_embeddings", "model/rms_norm_eps", "functions/cache_capacity_multiple",
                      "functions/cache", "functions/entry_points", "params/0/offset", "params/3/nbytes",
                      "params/4/shape", "params/5/dtype", "params/6/name", "target/arch", "target/features",
                      "files/params.bin", "quantization"]
    values = [0, -1, 1, 7, 2 ** 31, 2 ** 63, -(2 ** 40), 1.5, float("nan"), "x", "", None, [], {}, [1], True]
    flags = ["--temperature", "--top-p", "--top-k", "--repetition-penalty", "--seed", "--threads", "--ctx",
             "--max-new-tokens"]
    flag_values = ["nan", "-inf", "inf", "-1", "0", "1e308", "-0", "0x10", "", " ", "1,5", "3", "99999999999999999999",
                   "1e-320", "abc", "-2"]
    kinds = ["onnx-truncate", "onnx-flip", "manifest-value", "artifact-flip", "manifest-bytes", "flag",
             "prompt-bytes", "api-ids"]
    for i in range(n):
        kind = kinds[i % len(kinds)]
        r = rng.random()
        if kind == "onnx-truncate":
            cmd = rng.choice(["optimize", "compile"])
            frac = r
            out.append(Case("onnx", f"r{i}-{cmd}-truncate-{frac:.3f}", [cmd, "m.onnx", "-o", "o.out"],
                            setup=edit_bytes(lambda b, f=frac: b[:int(len(b) * f)]), output="o.out"))
        elif kind == "onnx-flip":
            k = rng.randint(1, 8)
            pos = [rng.random() for _ in range(k)]
            # Flips land in the weights as often as in the structure: a graph that still loads is
            # a valid (different) model, so both outcomes are right; what is checked is that
            # the output, if any, is a graph onnx accepts.
            out.append(Case("onnx", f"r{i}-optimize-flip-{k}", ["optimize", "m.onnx", "-o", "o.onnx"],
                            setup=edit_bytes(lambda b, ps=pos: _flips(b, ps)), output="o.onnx",
                            expect=("error", "ok"), check=graph_loads("o.onnx")))
        elif kind == "manifest-value":
            path, value = rng.choice(manifest_paths), rng.choice(values)
            # eos / bos ids change what generation does; every other field must either be
            # refused or leave the output as it was (the library does not read it)
            check = prints_something if path in ("model/eos_token_ids", "model/bos_token_id") else same_as_reference
            out.append(Case("artifact", f"r{i}-manifest-{path}={value!r}"[:80], art,
                            setup=edit_manifest(lambda m, p=path, v=value: _set_safe(m, p, v)),
                            expect=("error", "ok"), check=check))
        elif kind == "artifact-flip":
            name = rng.choice(["params.bin", "lib.so", "tokenizer.json"])
            at = rng.randrange(1 << 20)
            out.append(Case("artifact", f"r{i}-flip-{name}-{at}", art,
                            setup=lambda c, n=name, a=at: (copy_artifact(c), _flip(c / "a.qwc" / n, a)),))
        elif kind == "manifest-bytes":
            frac = r
            out.append(Case("artifact", f"r{i}-manifest-truncate-{frac:.3f}", art,
                            setup=edit_manifest(lambda m, f=frac: json.dumps(m)[:int(len(json.dumps(m)) * f)]),
                            expect=("error", "ok"), check=same_as_reference))
        elif kind == "flag":
            flag, value = rng.choice(flags), rng.choice(flag_values)
            out.append(Case("options", f"r{i}-run{flag}={value!r}", art[:-2] + ["--max-new-tokens", "4", flag, value]
                            if flag != "--max-new-tokens" else art[:-2] + [flag, value],
                            setup=copy_artifact, expect=_flag_expectation(flag, value), check=prints_something))
        elif kind == "prompt-bytes":
            raw = bytes(rng.randrange(1, 256) for _ in range(rng.randint(1, 40)))   # argv has no NUL
            text = raw.decode("utf-8", "surrogateescape")
            valid = True
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                valid = False
            out.append(Case("options", f"r{i}-prompt-bytes-{raw[:6].hex()}",
                            ["run", "a.qwc", "--prompt", text, "--max-new-tokens", "4"], setup=copy_artifact,
                            expect=("ok",) if valid else ("error",)))
        else:
            ids = [rng.choice([0, 1, 5, 287, 288, -1, 2 ** 31, 2 ** 40, -(2 ** 63)]) for _ in range(rng.randint(1, 5))]
            valid = all(0 <= t < 288 for t in ids)
            out.append(Case("options", f"r{i}-api-prefill-{ids}", api=f"    e = Engine('a.qwc')\n    e.prefill({ids})\n",
                            setup=copy_artifact, expect=("ok",) if valid else ("error",)))
    return out


def _flips(b: bytearray, positions: list[float]) -> bytearray:
    for p in positions:
        b[int(p * (len(b) - 1))] ^= 0x5A
    return b


def _set_safe(m, path, value):
    try:
        _set(m, path, value)
    except (KeyError, IndexError, TypeError, ValueError):
        pass


def _flag_expectation(flag: str, value: str) -> tuple[str, ...]:
    """What a flag value must give: refused unless it is a valid number in the flag's range."""
    try:
        v = float(value) if flag in ("--temperature", "--top-p", "--repetition-penalty") else int(value)
    except ValueError:
        return ("error",)
    import math

    from qwc.cpu import max_threads
    ok = {"--temperature": lambda: math.isfinite(v) and 0 <= v <= 1e4,
          "--top-p": lambda: math.isfinite(v) and 0 < v <= 1,
          "--repetition-penalty": lambda: math.isfinite(v) and 0 < v <= 1e4,
          "--top-k": lambda: v >= 0, "--seed": lambda: -1 <= v < 2 ** 63,
          "--threads": lambda: 1 <= v <= max_threads(), "--ctx": lambda: 8 <= v <= 2048,
          "--max-new-tokens": lambda: v >= 0}[flag]()
    if flag == "--ctx" and 1 <= v < 8:
        return ("error",)     # the prompt does not fit
    return ("ok",) if ok else ("error",)


# -- the campaign ----------------------------------------------------------------------------

def campaign(cases: list[Case], model: dict, root: Path, jobs: int = 2, echo=print) -> list[Result]:
    _MODEL.update(model)
    os.environ["QWC_FUZZ_BASE"] = str(model["base"])
    results = []
    serial = [c for c in cases if c.signal_at or c.needs_tmpfs or c.concurrent > 1]
    parallel = [c for c in cases if c not in serial]

    def one(c):
        r = run_case(c, model, root)
        echo(f"{r.outcome:16s} {c.family:8s} {c.name}  {r.detail[:150]}")
        return r

    with ThreadPoolExecutor(jobs) as ex:
        results += list(ex.map(one, parallel))
    results += [one(c) for c in serial]   # timing-sensitive: alone on the machine
    return results


def table(results: list[Result]) -> str:
    fams = [f for f in FAMILIES if any(r.case.family == f for r in results)]
    counts = {f: Counter(r.outcome for r in results if r.case.family == f) for f in fams}
    head = "| family | cases | " + " | ".join(OUTCOMES) + " |"
    rows = [head, "| --- | ---: | " + " | ".join("---:" for _ in OUTCOMES) + " |"]
    for f in fams + ["all"]:
        c = Counter(r.outcome for r in results) if f == "all" else counts[f]
        n = sum(c.values())
        rows.append(f"| {f} | {n} | " + " | ".join(str(c.get(o, 0)) for o in OUTCOMES) + " |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=320, help="total cases: every named case, then random ones")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="work folder (kept); default: a temp folder, removed")
    ap.add_argument("--json", type=Path, help="write every case's outcome here")
    ap.add_argument("--only", metavar="TEXT", help="run only the cases whose family/name contains TEXT")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="qwc-fuzz-"))
    try:
        t0 = time.perf_counter()
        model = prepare(root / "base")
        named = named_cases()
        cases = named + random_cases(max(0, args.cases - len(named)), args.seed)
        if args.only:
            cases = [c for c in cases if args.only in f"{c.family}/{c.name}"]
        n_named = sum(c in named for c in cases)
        print(f"{len(cases)} cases ({n_named} named, {len(cases) - n_named} random, seed {args.seed})", flush=True)
        results = campaign(cases, model, root / "cases", jobs=args.jobs, echo=lambda s: print(s, flush=True))
        print()
        print(table(results))
        bad = [r for r in results if r.outcome in BAD]
        for r in bad:
            print(f"  {r.outcome}: {r.case.family}/{r.case.name}: {r.detail}")
        print(f"\n{len(results)} cases in {time.perf_counter() - t0:.0f}s; {len(bad)} bad outcomes")
        if args.json:
            args.json.write_text(json.dumps([{"family": r.case.family, "name": r.case.name, "outcome": r.outcome,
                                              "detail": r.detail, "seconds": round(r.seconds, 2)}
                                             for r in results], indent=1))
        return 1 if bad else 0
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
