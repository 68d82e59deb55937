"""Without --ctx, `qwc serve` takes the model's trained context (capped by memory) and says which,
and `qwc run` its short default or the model's context where that is shorter: a model trained
on fewer positions than a fixed default starts instead of being refused. An explicit --ctx past
the model's positions is still one line."""

from __future__ import annotations

import subprocess
import sys
import time

from qwc.cli import main
from qwc.manifest import read_manifest
from qwc.runtime.context_size import CONTEXT_STEP, default_context, kv_bytes_per_token

from conftest import copy_artifact, edit_manifest, one_line

GiB = 2**30


def _short(art, tmp_path, positions=256):
    """The tiny artifact, its model said to be trained on `positions` (fewer than the 2048 it
    has: every table the library holds covers them)."""
    short = copy_artifact(art, tmp_path)
    edit_manifest(short, lambda m: m["model"].update(max_position_embeddings=positions))
    return short


def test_the_choice(tiny_host_artifact):
    m = read_manifest(tiny_host_artifact)
    per_token = kv_bytes_per_token(m)
    assert per_token == 2 * 2 * 2 * 32 * 4   # layers x (key, value) x kv heads x head dim x float32
    assert default_context(m, 8, available=64 * GiB) == (2048, "the model's trained context")
    assert default_context(m, 1, cap=512, available=64 * GiB)[0] == 512
    # half of the memory of 4 x 2 x 1000 positions: 1000 a sequence of 4 -> the step's multiple below it
    ctx, why = default_context(m, 4, available=4 * 2 * 1000 * per_token)
    assert ctx == 1000 // CONTEXT_STEP * CONTEXT_STEP == 768 and "capped by memory" in why and "2048" in why
    assert default_context(m, 4, available=1)[0] == CONTEXT_STEP   # never below one step


def test_serve_on_a_short_model_starts_and_says_its_context(tiny_host_artifact, tmp_path):
    short = _short(tiny_host_artifact, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "qwc", "serve", str(short), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        lines, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "serving" in line:
                break
        said = "".join(lines)
        assert "context: 256 tokens a sequence (the model's trained context" in said, said
        assert "sequences of up to 256 tokens" in said, said
    finally:
        proc.kill()
        proc.wait()


def test_serve_refuses_a_ctx_past_the_model(capsys, tiny_host_artifact, tmp_path):
    short = _short(tiny_host_artifact, tmp_path)
    capsys.readouterr()
    one_line(capsys, main(["-q", "serve", str(short), "--port", "0", "--ctx", "4096"]),
             "ctx 4096 exceeds the model's 256 positions")


def test_run_without_ctx_on_a_short_model(capsys, tiny_host_artifact, tmp_path):
    short = _short(tiny_host_artifact, tmp_path, positions=128)   # under run's default of 512
    assert main(["-q", "run", str(short), "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    one_line(capsys, main(["-q", "run", str(short), "--prompt", "hi", "--ctx", "512"]),
             "ctx 512 exceeds the model's 128 positions")
