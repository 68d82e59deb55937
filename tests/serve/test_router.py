"""Several models behind one `qwc serve` (runtime/router.py): the tiny Qwen2 and the tiny Qwen3,
each request routed by its `model`. With --models-max 1, alternating requests all succeed and
each reply is that model's served alone (greedy); with --models-max 2, a stream on one goes on
while the other loads; an unknown model is a 404 naming both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from qwc.cli import main
from qwc.runtime.engine import Engine
from qwc.runtime.sampling import SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def artifacts(tiny_q4, tmp_path_factory):
    d = tmp_path_factory.mktemp("router")
    assert main(["-q", "compile", str(tiny_q4), "--max-batch", "2", "-o", str(d / "qwen2.qwc")]) == 0
    assert main(["-q", "export", "tiny-qwen3", "-o", str(d / "q3.onnx")]) == 0
    assert main(["-q", "compile", str(d / "q3.onnx"), "--max-batch", "2", "-o", str(d / "qwen3.qwc")]) == 0
    return d


class Served:
    def __init__(self, *args, threads: int = 1):
        self.proc = subprocess.Popen([sys.executable, "-m", "qwc", "serve", *map(str, args), "--port", "0",
                                      "--threads", str(threads), "--ctx", "2048"],
                                     stderr=subprocess.PIPE, text=True)
        said = ""
        for line in self.proc.stderr:
            said += line
            if m := re.search(r"at (http://[^ ]+)/v1", line):
                self.base = m[1]
                threading.Thread(target=self.proc.stderr.read, daemon=True).start()   # keep the pipe drained
                return
        raise AssertionError(f"server did not start: {said}")

    def complete(self, model: str, n: int = 8) -> httpx.Response:
        return httpx.post(self.base + "/v1/completions", timeout=120,
                          json={"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True})

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def _alone(art) -> str:
    eng = Engine(art, ctx=2048, threads=1)
    return "".join(eng.generate(PROMPT, max_new_tokens=8, sampling=SamplingParams(), stop=set()))


def test_alternating_models_with_one_resident_reply_as_each_alone(artifacts):
    want = {m: _alone(artifacts / f"{m}.qwc") for m in ("qwen2", "qwen3")}
    s = Served(artifacts / "qwen2.qwc", artifacts / "qwen3.qwc", "--models-max", "1")
    try:
        listed = httpx.get(s.base + "/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["qwen2", "qwen3"]
        for model in ("qwen2", "qwen3", "qwen2", "qwen3"):
            r = s.complete(model)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[model], model
        r = s.complete("nope")
        assert r.status_code == 404 and "'qwen2', 'qwen3'" in r.json()["error"]["message"]
        loaded = [m["id"] for m in httpx.get(s.base + "/v1/models").json()["data"] if m["status"]["value"] == "loaded"]
        assert loaded == ["qwen3"]   # one resident: the last used
    finally:
        s.close()


def test_a_stream_goes_on_while_the_other_model_loads(artifacts):
    # the stream's model on every core, as a server is run: the load has none of its own
    s = Served(artifacts, "--models-max", "2", threads=len(os.sched_getaffinity(0)))   # the folder of both
    try:
        times, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", s.base + "/v1/completions", timeout=120,
                              json={"model": "qwen2", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
                                    "stream": True, "temperature": 0}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120)
        start = time.perf_counter()
        r = s.complete("qwen3")   # loads qwen3 beside the running stream
        assert r.status_code == 200
        end = time.perf_counter()
        t.join(120)
        assert len(times) >= 2000
        # the stream went on during the load and reply (whether or not it outlived them: on a
        # quiet machine the tiny model's 2,000 tokens may end first). How fast it went is
        # bench/models.py's to measure: this tiny model's tokens come faster than Python's GIL
        # changes hands, and the tests beside this one take the cores (tests/serve/
        # test_router_policy.py holds the load to the lowest priority).
        assert sum(start < x < end for x in times) >= 2
        assert max(b - a for a, b in zip(times, times[1:])) < 5   # no stall the length of a load and more
    finally:
        s.close()
