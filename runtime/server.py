"""`qwc serve`: the OpenAI HTTP API over the continuous-batching scheduler.

/v1/completions and /v1/chat/completions (streaming as server-sent events, or one JSON reply),
/v1/models, /health, and Prometheus /metrics. Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 for a bad request (malformed JSON, an
unknown model, a prompt longer than the context, sampling values out of range, options this
server does not implement), 401 without the --api-key, 503 when the queue is full.

FastAPI / uvicorn / prometheus-client are the optional extra `qwc[serve]`: the runtime's core
(engine, scheduler) does not need them. Request fields follow OpenAI's defaults (temperature 1,
max_tokens 16 for completions and the rest of the context for chat; presence_penalty and
frequency_penalty over the generated tokens, logit_bias by token id) and accept llama-server's
`top_k`, `repeat_penalty` and `ignore_eos` beside them.
"""


import asyncio
import json
import math
import secrets
import time
from dataclasses import dataclass

from qwc.errors import QwcError

from .sampling import SamplingParams
from .scheduler import QueueFull, Request, Scheduler


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Settings:
    model_id: str
    api_key: str | None = None


# -- request validation -------------------------------------------------------------------

def _number(body: dict, name: str, default, lo, hi, integer=False, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        span = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'} in {span}, not {v!r}", name)
    return v


def _unsupported(body: dict) -> None:
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise ApiError(400, "only n = 1 (and best_of = 1) is supported", "n")
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
        if body.get(name) not in (None, False, "", [], {}):
            raise ApiError(400, f"'{name}' is not supported by this server", name)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    return tuple(stop)


def _logit_bias(body: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (JSON keys are strings)."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > 1024:
        raise ApiError(400, "'logit_bias' must be an object of at most 1024 token ids to biases", "logit_bias")
    out = {}
    for k, v in bias.items():
        tok = int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else -1
        if not 0 <= tok < vocab:
            raise ApiError(400, f"'logit_bias': {k!r} is not a token id in [0, {vocab})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise ApiError(400, f"'logit_bias': the bias of {k} must be a number in [-100, 100], not {v!r}",
                           "logit_bias")
        out[tok] = float(v)
    return out


def _sampling(body: dict, vocab: int) -> SamplingParams:
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError(400, f"'seed' must be an integer in [0, 2^63), not {seed!r}", "seed")
    return SamplingParams(temperature=float(_number(body, "temperature", 1.0, 0, 2)),
                          top_p=float(_number(body, "top_p", 1.0, 0, 1, lo_open=True)),
                          top_k=int(_number(body, "top_k", 0, 0, 1 << 30, integer=True)),
                          repetition_penalty=float(_number(body, "repeat_penalty", 1.0, 0, 100, lo_open=True)),
                          presence_penalty=float(_number(body, "presence_penalty", 0.0, -2, 2)),
                          frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -2, 2)),
                          logit_bias=_logit_bias(body, vocab), seed=seed)


class Api:
    """The endpoints' logic, independent of the web framework (the FastAPI app below wraps it)."""

    def __init__(self, engine, scheduler: Scheduler, settings: Settings, metrics=None):
        self.engine, self.scheduler, self.settings, self.metrics = engine, scheduler, settings, metrics
        self.created = int(time.time())
        self._chat = None

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.settings.model_id, "object": "model",
                                            "created": self.created, "owned_by": "qwc"}]}

    def check_key(self, authorization: str | None) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", kind="authentication_error")

    def parse(self, raw: bytes, chat: bool) -> tuple[Request, dict]:
        """A validated Request (not yet submitted) and the reply's fixed fields."""
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model != self.settings.model_id:
            raise ApiError(400, f"model {model!r} does not exist; this server has {self.settings.model_id!r}",
                           "model", "model_not_found")
        _unsupported(body)
        prompt = self._chat_prompt(body) if chat else self._prompt(body)
        ctx = self.engine.ctx
        if len(prompt) + 1 > ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; this server's context is {ctx} tokens "
                                "(with room for at least one more)", "messages" if chat else "prompt",
                           "context_length_exceeded")
        room = ctx - len(prompt)
        name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = _number(body, name, room if chat else 16, 1, 1 << 31, integer=True)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", "stream")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "'ignore_eos' must be true or false", "ignore_eos")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        try:
            sampling = _sampling(body, self.engine.vocab_size)
        except QwcError as e:
            raise ApiError(400, str(e)) from None
        req = Request(prompt=prompt, max_tokens=min(max_tokens, room), sampling=sampling, emit=None,
                      stop_strings=_stops(body), ignore_eos=ignore_eos)
        return req, {"stream": stream, "include_usage": bool(opts.get("include_usage"))}

    def _prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' is empty", "prompt")
            return self._encode(p, "prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not all(0 <= t < self.engine.vocab_size for t in p):
                raise ApiError(400, f"'prompt' token ids must be in [0, {self.engine.vocab_size})", "prompt")
            return list(p)
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt")

    def _chat_prompt(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
                raise ApiError(400, "each message needs a 'role' of system, user, assistant or developer", "messages")
            content = m.get("content")
            if isinstance(content, list):   # content parts: text only
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise ApiError(400, "only text content parts are supported", "messages")
                content = "".join(c["text"] for c in content)
            if not isinstance(content, str):
                raise ApiError(400, "each message needs a string 'content'", "messages")
            clean.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        if self._chat is None:
            from .chat import ChatTemplate

            try:
                self._chat = ChatTemplate(self.engine.model.chat_template)
            except QwcError as e:
                raise ApiError(400, f"{e}; use /v1/completions", "messages") from None
        try:
            text = self._chat.render(clean)
        except QwcError as e:
            raise ApiError(400, str(e), "messages") from None
        return self._encode(text, "messages")

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            ids = self.engine.encode(text)
        except QwcError as e:
            raise ApiError(400, str(e), param) from None
        if not ids:
            raise ApiError(400, f"'{param}' encodes to no tokens", param)
        return ids

    def submit(self, req: Request, emit) -> Request:
        req.emit = emit
        try:
            return self.scheduler.submit(req)
        except QueueFull as e:
            raise ApiError(503, f"{e}; retry later", code="server_overloaded", kind="server_error") from None
        except QwcError as e:
            raise ApiError(400, str(e)) from None


def create_app(engine, scheduler: Scheduler, settings: Settings):
    """The FastAPI application (needs the `serve` extra)."""
    try:
        from fastapi import FastAPI
        from fastapi import Request as HttpRequest
        from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    except ImportError:
        raise QwcError("qwc serve needs the serve extra: pip install 'qwc[serve]'") from None
    from .metrics import Metrics

    metrics = Metrics(scheduler)
    api = Api(engine, scheduler, settings, metrics)
    app = FastAPI(title="qwc", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        metrics.request_done("error", e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(404)
    async def not_found(request, _):
        return JSONResponse(ApiError(404, f"no route {request.method} {request.url.path}").body(), status_code=404)

    @app.exception_handler(405)
    async def wrong_method(request, _):
        return JSONResponse(ApiError(405, f"{request.method} is not allowed on {request.url.path}").body(),
                            status_code=405)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: HttpRequest):
        api.check_key(request.headers.get("authorization"))
        return api.models()

    async def complete(request: HttpRequest, chat: bool):
        api.check_key(request.headers.get("authorization"))
        req, opts = api.parse(await request.body(), chat)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        api.submit(req, lambda kind, value: loop.call_soon_threadsafe(events.put_nowait, (kind, value)))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        shape = _Shape(rid, settings.model_id, chat)
        metrics.request_started()

        async def watch():
            # notice a client that went away (a task of its own: a timeout on every token's wait
            # cost the event loop a task per token, CPU the decode threads want)
            while req.finish_reason is None:
                await asyncio.sleep(0.5)
                if await request.is_disconnected():
                    req.cancel()
                    return

        watcher = asyncio.create_task(watch())
        next_event = events.get

        if opts["stream"]:
            async def sse():
                done = False
                try:
                    if chat:
                        yield _sse(shape.chunk({"role": "assistant", "content": ""}, None))
                    while True:
                        kind, value = await next_event()
                        if kind == "text":
                            yield _sse(shape.chunk({"content": value} if chat else value, None))
                            continue
                        done = True
                        if value.startswith("error"):
                            yield _sse(ApiError(500, value, kind="server_error").body())
                        elif value != "cancelled":
                            yield _sse(shape.chunk({} if chat else "", value))
                            if opts["include_usage"]:
                                yield _sse(shape.usage_chunk(req))
                        yield "data: [DONE]\n\n"
                        metrics.request_done(value, 200, req)
                        return
                finally:
                    watcher.cancel()
                    if not done:          # the client went away mid-stream
                        req.cancel()
                        metrics.request_done("cancelled", 499, req)

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        text = []
        try:
            while True:
                kind, value = await next_event()
                if kind == "text":
                    text.append(value)
                    continue
                break
        finally:
            watcher.cancel()
            if req.finish_reason is None:
                req.cancel()
        if value.startswith("error"):
            metrics.request_done(value, 500, req)
            return JSONResponse(ApiError(500, value, kind="server_error").body(), status_code=500)
        metrics.request_done(value, 200, req)
        return shape.whole("".join(text), value, req)

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shape:
    """OpenAI's reply objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool):
        self.rid, self.model, self.chat, self.created = rid, model, chat, int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta, finish: str | None) -> dict:
        if self.chat:
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}]}

    @staticmethod
    def usage(req: Request) -> dict:
        n, m = len(req.prompt), len(req.generated)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": req.cached_tokens}}   # OpenAI's prompt-cache field

    def usage_chunk(self, req: Request) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(req)}

    def whole(self, text: str, finish: str, req: Request) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage(req)}
        return {**self._head("text_completion"),
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": self.usage(req)}
