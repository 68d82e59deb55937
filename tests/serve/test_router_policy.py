"""runtime/router.py with stand-in models (an ASGI app each that names itself): routing by
`model`, the least recently used idle model unloaded for another, never one with a request in
flight, the 404 naming the models, and the API key on /v1/models."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import httpx

from qwc.runtime.router import ModelRouter, artifact_paths


class _Sched:
    def __init__(self, log, name):
        self.log, self.name, self.started = log, name, False

    def start(self):
        self.started = True

    def stop(self):
        self.log.append(f"stop {self.name}")


def _router(tmp_path, models_max=1, api_key=None, gate: asyncio.Event | None = None):
    """A router over artifacts a, b, c (folders with a manifest) whose apps answer {"model": name},
    a's waiting for `gate` first; and the log of loads and unloads."""
    for m in "abc":
        (tmp_path / f"{m}.qwc").mkdir()
        (tmp_path / f"{m}.qwc" / "manifest.json").write_text("{}")
    log = []

    def load(name, path):
        log.append(f"load {name}")

        async def app(scope, receive, send):
            await receive()
            if name == "a" and gate is not None:
                await gate.wait()
            body = json.dumps({"model": name}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body})
        return None, _Sched(log, name), app

    return ModelRouter(artifact_paths([str(tmp_path)]), load, models_max, None, api_key), log


def _client(router):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://t")


def test_requests_go_to_their_model_and_the_least_recently_used_idle_one_goes(tmp_path):
    router, log = _router(tmp_path, models_max=2)

    async def run():
        async with _client(router) as c:
            for m in ("a", "b", "a", "c"):
                r = await c.post("/v1/completions", json={"model": m})
                assert r.json() == {"model": m}
            r = await c.post("/v1/completions", json={"model": "z"})
            assert r.status_code == 404 and "'a', 'b', 'c'" in r.json()["error"]["message"]
            models = (await c.get("/v1/models")).json()["data"]
            assert {m["id"]: m["status"]["value"] for m in models} == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    asyncio.run(run())
    assert log == ["load a", "load b", "stop b", "load c"]   # b was the least recently used


def test_a_load_runs_at_the_lowest_priority_and_its_scheduler_at_the_servers(tmp_path):
    """The load competes for the cores with the other models' streams at the lowest priority,
    SCHED_IDLE (a thread of its own); the scheduler it built is started afterwards from the
    server's thread, so what serves the model does not inherit that priority."""
    router, log = _router(tmp_path, models_max=2)
    seen = {}
    load = router.load

    def niced_load(name, path):
        seen[name] = (threading.get_native_id(), os.sched_getscheduler(0))
        return load(name, path)
    router.load = niced_load

    async def run():
        async with _client(router) as c:
            for m in ("a", "b"):
                assert (await c.post("/v1/completions", json={"model": m})).status_code == 200
        return threading.get_native_id(), os.sched_getscheduler(0)
    server_thread, server_policy = asyncio.run(run())
    assert {m: policy for m, (_, policy) in seen.items()} == {"a": os.SCHED_IDLE, "b": os.SCHED_IDLE}
    assert server_thread not in {tid for tid, _ in seen.values()} and server_policy == os.SCHED_OTHER
    assert all(r.scheduler.started for r in router.resident.values()) and len(router.resident) == 2


def test_a_model_with_a_request_in_flight_is_not_unloaded(tmp_path):
    async def run():
        gate = asyncio.Event()
        router, log = _router(tmp_path, models_max=1, gate=gate)
        async with _client(router) as c:
            slow = asyncio.create_task(c.post("/v1/completions", json={"model": "a"}))
            await asyncio.sleep(0.2)
            other = asyncio.create_task(c.post("/v1/completions", json={"model": "b"}))
            await asyncio.sleep(0.2)
            assert log == ["load a"] and not other.done()   # b waits for a's request
            gate.set()
            assert (await slow).json() == {"model": "a"} and (await other).json() == {"model": "b"}
        assert log == ["load a", "stop a", "load b"]
    asyncio.run(run())


def test_the_model_list_asks_for_the_api_key(tmp_path):
    router, _ = _router(tmp_path, api_key="k")

    async def run():
        async with _client(router) as c:
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.get("/v1/models", headers={"Authorization": "Bearer k"})).status_code == 200
            assert (await c.get("/health")).json() == {"status": "ok"}
    asyncio.run(run())
