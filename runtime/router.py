"""`qwc serve A.qwc B.qwc ...` (or a folder of artifacts): several models behind one address,
each request routed by its `model` field, as llama-server's router mode and llama-swap do.

Each model, once loaded, is what `qwc serve` runs for one artifact (runtime/serving.py:
server_parts): its own engine, scheduler (so its own KV cache and batches) and HTTP app, to
which the router hands the request whole (an ASGI call with the body it read). At most
`--models-max` are resident: a request for another loads it in a thread of the lowest CPU
priority, so the streams of the resident ones go on at their speed meanwhile, after unloading
the least recently used model that has no request in flight (weights are mapped, so a load is
cheap and an unload frees them). A model no artifact provides is OpenAI's 404 naming the ones
there are.

What is not a model's: `GET /v1/models` (every model, loaded or not), `/health`, the chat page
at `/`. `/props`, `/slots` and `/metrics` take `?model=ID` (without it: the model last used).
A body without `model` (/tokenize, /detokenize) goes to the first model listed."""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs

from qwc import progress
from qwc.errors import QwcError

from .priority import lowest_priority


def holds_artifacts(given: str) -> bool:
    """Whether `given` is a folder of artifacts (not one itself)."""
    p = Path(given)
    return p.is_dir() and not (p / "manifest.json").is_file() and any(p.glob("*/manifest.json"))


def artifact_paths(given: list[str]) -> dict[str, Path]:
    """Model id (the folder's name without .qwc) -> artifact folder, from the command line's
    artifacts or folders holding artifacts; an id given twice is an error."""
    paths: dict[str, Path] = {}
    for g in given:
        p = Path(g)
        if (p / "manifest.json").is_file():
            found = [p]
        elif p.is_dir():
            found = sorted(q.parent for q in p.glob("*/manifest.json"))
            if not found:
                raise QwcError(f"{g}: neither an artifact nor a folder of artifacts (no manifest.json)")
        else:
            raise QwcError(f"{g}: no such artifact folder")
        for a in found:
            name = a.resolve().name.removesuffix(".qwc")
            if name in paths and paths[name] != a:
                raise QwcError(f"two artifacts are named {name!r} ({paths[name]}, {a}); rename one")
            paths[name] = a
    return paths


async def _in_background(fn, *args):
    """fn(*args) in a thread of its own at the lowest CPU priority, awaited. A load's work
    (reading the library, committing the KV cache's pages, the first call) competes for the
    cores with the resident models' streams, which on a small machine hold every core: at the
    lowest priority it takes what they leave instead of slowing them. A fresh thread, because
    a thread's priority cannot be raised back without privileges, and anything it starts
    inherits it."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def work():
        lowest_priority()
        try:
            result = fn(*args)
        except BaseException as e:   # noqa: BLE001 -- handed to the awaiting coroutine as it is
            loop.call_soon_threadsafe(_settle, done, None, e)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=work, name="qwc-load", daemon=True).start()
    return await done


def _settle(done: asyncio.Future, result, error) -> None:
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


@dataclass
class _Resident:
    engine: object
    scheduler: object
    app: object
    in_flight: int = 0
    used: float = field(default_factory=time.monotonic)


class ModelRouter:
    """The ASGI application. `load(id, path)` builds a model's (engine, started scheduler, app)."""

    def __init__(self, paths: dict[str, Path], load, models_max: int, page: str | None, api_key: str | None = None):
        if models_max < 1:
            raise QwcError("--models-max must be at least 1")
        self.paths, self.load, self.models_max, self.page = paths, load, models_max, page
        self.api_key = api_key   # /v1/models asks for it, as each model's own /v1 routes do
        self.resident: collections.OrderedDict[str, _Resident] = collections.OrderedDict()
        self._locks = {m: asyncio.Lock() for m in paths}
        self._room = asyncio.Condition()
        self.created = int(time.time())
        self.last: str | None = None

    # -- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/v1/models", "/health", "/"):
            if path == "/v1/models" and not self._authorized(scope):
                return await _json(send, 401, _Refused(401, "invalid or missing API key (send 'Authorization: "
                                                            "Bearer KEY')", code="invalid_api_key",
                                                       kind="authentication_error").body)
            return await self._own(path, send)
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        try:
            model = self._model_of(scope, body)
            entry = await self._resident_model(model)
        except _Refused as e:
            return await _json(send, e.status, e.body)
        entry.in_flight += 1
        entry.used = time.monotonic()
        self.last = model
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # (the client's disconnect, which a streaming reply watches)

        try:
            await entry.app(scope, replay, send)
        finally:
            entry.in_flight -= 1
            async with self._room:
                self._room.notify_all()

    def _authorized(self, scope) -> bool:
        if self.api_key is None:
            return True
        given = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
        return secrets.compare_digest(given.removeprefix("Bearer ").strip().encode(), self.api_key.encode())

    def _model_of(self, scope, body: bytes) -> str:
        """The model a request names: its body's `model`, or `?model=` on a GET."""
        model = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[0]
        if model is None and body:
            try:
                parsed = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                parsed = None   # the model's app answers malformed JSON with its own 400
            model = parsed.get("model") if isinstance(parsed, dict) else None
        if model is None:
            model = self.last if scope["method"] == "GET" and self.last else next(iter(self.paths))
        if not isinstance(model, str) or model not in self.paths:
            have = ", ".join(repr(m) for m in self.paths)
            raise _Refused(404, f"model {model!r} does not exist; this server has {have}", "model", "model_not_found")
        return model

    # -- residency ---------------------------------------------------------------------------
    async def _resident_model(self, model: str) -> _Resident:
        async with self._locks[model]:   # one load of a model at a time; its other requests wait for it
            if model in self.resident:
                self.resident.move_to_end(model)
                return self.resident[model]
            await self._make_room()
            t0 = time.perf_counter()
            try:
                eng, sched, app = await _in_background(self.load, model, self.paths[model])
            except QwcError as e:
                raise _Refused(500, f"model {model!r} failed to load: {e}", "model", kind="server_error") from None
            sched.start()   # from this thread: its own thread (and the TVM pool it makes) at the server's priority
            progress.info(f"[qwc] loaded {model!r} in {time.perf_counter() - t0:.1f}s "
                          f"({len(self.resident) + 1} of at most {self.models_max} resident)")
            self.resident[model] = _Resident(eng, sched, app)
            return self.resident[model]

    async def _make_room(self) -> None:
        """Unload least recently used models without requests in flight until one more fits
        (waiting while every resident one is busy)."""
        async with self._room:
            while len(self.resident) >= self.models_max:
                idle = [m for m, r in self.resident.items() if r.in_flight == 0]
                if idle:
                    self._unload(min(idle, key=lambda m: self.resident[m].used))
                else:
                    await self._room.wait()

    def _unload(self, model: str) -> None:
        r = self.resident.pop(model)
        r.scheduler.stop()
        del r
        gc.collect()
        progress.info(f"[qwc] unloaded {model!r} (the least recently used with no request in flight)")

    def close(self) -> None:
        for m in list(self.resident):
            self.resident.pop(m).scheduler.stop()

    # -- the router's own answers -------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": self.created, "owned_by": "qwc",
             "status": {"value": "loaded" if m in self.resident else "unloaded"}} for m in self.paths]}

    async def _own(self, path: str, send) -> None:
        if path == "/v1/models":
            return await _json(send, 200, self.models())
        if path == "/health":
            return await _json(send, 200, {"status": "ok"})
        if self.page is None:
            return await _json(send, 404, _Refused(404, "no route GET /").body)
        data = self.page.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/html; charset=utf-8"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _json(send, status: int, obj) -> None:
    data = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
