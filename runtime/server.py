"""`qwc serve`: the OpenAI HTTP API over the continuous-batching scheduler.

/v1/completions and /v1/chat/completions (streaming as server-sent events, or one JSON reply),
/v1/embeddings (runtime/embedding_requests.py), /v1/models, /health, Prometheus /metrics, and
llama-server's /tokenize, /detokenize, /props and /slots (runtime/server_info.py). Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}: 400 for a bad request (malformed JSON, a
prompt longer than the context, sampling values out of range, options this server does not
implement), 404 for a model that is neither the base nor an adapter it serves (OpenAI's
model_not_found), 401 without the --api-key, 503 when the queue is full.

FastAPI / uvicorn / prometheus-client / llguidance are the optional extra `qwc[serve]`: the
runtime's core (engine, scheduler) does not need them. Request fields follow OpenAI's defaults
(temperature 1, max_tokens 16 for completions and the rest of the context for chat;
presence_penalty and frequency_penalty over the generated tokens, logit_bias by token id) and
accept llama-server's `top_k`, `repeat_penalty`, `ignore_eos` and GBNF `grammar` beside them.
`response_format` (json_object, json_schema) and `grammar` constrain the reply
(runtime/grammar.py); logprobs are the model's own distribution (before penalties, bias,
grammar and temperature, as OpenAI and vLLM report them): chat's `logprobs` / `top_logprobs`
(0-20), the completions' `logprobs: N` (0-20) and `echo`.
"""


import asyncio
import functools
import json
import math
import secrets
import time
from dataclasses import dataclass, field, replace

from qwc.errors import QwcError

from . import embedding_requests, server_info
from .reasoning import ReasoningStream, split_reasoning
from .sampling import SamplingParams
from .scheduler import QueueFull, Request, Scheduler
from .tools import CallStream, ToolError, call_grammar, fallback_messages, parse_tools, split_calls, template_messages


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
    reasoning_format: str = "auto"   # runtime/reasoning.py: FORMATS (a request's reasoning_format overrides it)
    template_variables: dict = field(default_factory=dict)   # --chat-template-kwargs, under a request's own
    webui: bool = True   # the chat page at / (runtime/chat_page.html; --no-webui, as llama-server's flag)
    pooling: str = "last"   # /v1/embeddings' default (runtime/embeddings.py: POOLINGS; --pooling)


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


MAX_N = 16   # replies a request may ask for (each is a sequence slot while it runs)


def _unsupported(body: dict, chat: bool) -> None:
    if body.get("best_of") not in (None, 1):
        raise ApiError(400, "only best_of = 1 is supported (n replies are n = ...)", "best_of")
    for name in ("suffix", "functions") + (("echo",) if chat else ("tools",)):
        if body.get(name) not in (None, False, "", [], {}):
            raise ApiError(400, f"'{name}' is not supported by this server", name)


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many likeliest tokens to report beside each chosen one's logprob; None: no logprobs.
    Chat: logprobs true and top_logprobs 0-20; completions: logprobs N (OpenAI's legacy form)."""
    if chat:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise ApiError(400, f"'logprobs' must be true or false, not {on!r}", "logprobs")
        top = _number(body, "top_logprobs", None, 0, 20, integer=True)
        if top is not None and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    if body.get("top_logprobs") is not None:
        raise ApiError(400, "'top_logprobs' is a chat field; completions take 'logprobs': N", "top_logprobs")
    return _number(body, "logprobs", None, 0, 20, integer=True)


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
        self._vocab = None

    def models(self) -> dict:
        """The base, then each adapter served on it (`qwc serve --lora NAME=PATH`), as vLLM lists
        them: an adapter's `parent` is the base."""
        base = {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "qwc"}
        names = self.engine.adapters.names if self.engine.adapters is not None else []
        return {"object": "list", "data": [base] + [{"id": n, "object": "model", "created": self.created,
                                                    "owned_by": "qwc", "root": n, "parent": self.settings.model_id}
                                                   for n in names]}

    def adapter_slot(self, model) -> int:
        """The slot of the model a request names: 0 for the base (or no name, as llama-server and
        vLLM take a request without `model`), an adapter's own; OpenAI's 404 for any other name."""
        if model is None or model == self.settings.model_id:
            return 0
        names = self.engine.adapters.names if self.engine.adapters is not None else []
        if isinstance(model, str) and model in names:
            return self.engine.adapter_slot(model)
        have = ", ".join(repr(m) for m in [self.settings.model_id, *names])
        raise ApiError(404, f"model {model!r} does not exist; this server has {have}", "model", "model_not_found")

    def check_key(self, authorization: str | None) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           code="invalid_api_key", kind="authentication_error")

    def parse(self, raw: bytes, chat: bool) -> tuple[list[Request], dict]:
        """The validated Requests (n of them, not yet submitted) and the reply's fixed fields."""
        body = server_info.checked_json(raw, ApiError)
        adapter = self.adapter_slot(body.get("model"))
        _unsupported(body, chat)
        top = _logprobs(body, chat)
        echo = body.get("echo", False)
        if not isinstance(echo, bool):
            raise ApiError(400, "'echo' must be true or false", "echo")
        if echo and top is not None:
            raise ApiError(400, "'echo' with 'logprobs' (the prompt's own logprobs) is not supported", "echo")
        fns, choice = [], "none"
        if chat:
            try:
                fns, choice = parse_tools(body.get("tools"), body.get("tool_choice"))
            except ToolError as e:
                raise ApiError(400, str(e), e.param) from None
        reasoning = None
        if chat:
            prompt, text = self._chat_prompt(body, fns if choice != "none" else [])
            reasoning = self._reasoning(body, text)
        else:
            prompt = self._prompt(body)
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
        grammar = self._grammar(body)
        if choice not in (None, "none"):    # "required" or a function's name: the reply is one call
            if grammar is not None:
                raise ApiError(400, "'tool_choice' required or a function cannot be combined with "
                                    "'response_format' or 'grammar'", "tool_choice")
            grammar = self._checked(call_grammar(fns, None if choice == "required" else choice, self.token_vocab()), "tools")
        if grammar is not None and reasoning is not None:   # the answer follows it, the thinking does not
            from .reasoning import thinking_grammar
            grammar = thinking_grammar(grammar, self.token_vocab(), reasoning)
        if grammar is not None and ignore_eos:
            raise ApiError(400, "'ignore_eos' cannot be used with a grammar or response_format: "
                                "the reply ends where the grammar does", "ignore_eos")
        n = _number(body, "n", 1, 1, MAX_N, integer=True)
        stops = _stops(body)
        reqs: list[Request] = []
        for i in range(n):   # the first prefills the prompt, the others copy its cache
            sp = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=(sampling.seed + i) % 2**63)
            reqs.append(Request(prompt=prompt, max_tokens=min(max_tokens, room), sampling=sp, emit=None,
                                stop_strings=stops, ignore_eos=ignore_eos, logprobs=top,
                                constraint=self.token_vocab().constraint(grammar) if grammar is not None else None,
                                fork_of=reqs[0] if reqs else None, adapter=adapter))
        shown = None
        if echo:
            shown = body["prompt"] if isinstance(body.get("prompt"), str) else self.engine.tokenizer.decode(prompt)
        return reqs, {"model": body.get("model") or self.settings.model_id, "stream": stream,
                      "include_usage": bool(opts.get("include_usage")),
                      "echo": shown, "tools": bool(fns) and choice != "none", "reasoning": reasoning}

    def _checked(self, lark: str, param: str) -> str:
        """A Lark grammar, checked against this tokenizer."""
        try:
            self._grammar_vocab(param).check(lark, f"'{param}'")
        except QwcError as e:
            raise ApiError(400, str(e), param) from None
        return lark

    def _grammar_vocab(self, param: str):
        """token_vocab(), or a 400 naming `param` where the artifact has no tokenizer."""
        if self.engine.tokenizer is None:
            raise ApiError(400, "this artifact has no tokenizer, so it cannot follow a grammar", param)
        return self.token_vocab()

    def token_vocab(self):
        """The tokenizer as the grammar engine sees it (built on first use, ~1 s)."""
        if self._vocab is None:
            from .grammar import TokenVocab

            e = self.engine
            self._vocab = TokenVocab(e.tokenizer, e.vocab_size, e.eos, e.sample_limit)
        return self._vocab

    def _grammar(self, body: dict) -> str | None:
        """The reply's grammar: OpenAI's response_format, or llama-server's GBNF `grammar`."""
        fmt, gbnf = body.get("response_format"), body.get("grammar")
        if fmt is None and gbnf is None:
            return None
        if fmt is not None and gbnf is not None:
            raise ApiError(400, "give 'response_format' or 'grammar', not both", "grammar")
        param = "grammar" if gbnf is not None else "response_format"
        vocab = self._grammar_vocab(param)
        from .grammar import response_format_grammar

        try:
            if gbnf is None:
                return response_format_grammar(fmt, vocab)
            if not isinstance(gbnf, str) or not gbnf.strip():
                raise QwcError("'grammar' must be a non-empty GBNF string")
            g = vocab.gbnf_grammar(gbnf)
            vocab.check(g)
            return g
        except QwcError as e:
            raise ApiError(400, str(e), param) from None

    def _prompt(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' is empty", "prompt")
            return self.encode_text(p, "prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not all(0 <= t < self.engine.vocab_size for t in p):
                raise ApiError(400, f"'prompt' token ids must be in [0, {self.engine.vocab_size})", "prompt")
            return list(p)
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", "prompt")

    def _chat_prompt(self, body: dict, fns: list[dict]) -> tuple[list[int], str]:
        """The chat request's prompt: its tokens and its text."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
                raise ApiError(400, "each message needs a 'role' of system, user, assistant, developer or tool",
                               "messages")
            content = m.get("content")
            if isinstance(content, list):   # content parts: text only
                if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                           for c in content):
                    raise ApiError(400, "only text content parts are supported", "messages")
                content = "".join(c["text"] for c in content)
            calls = m.get("tool_calls") if m["role"] == "assistant" else None
            if calls is not None and not isinstance(calls, list):
                raise ApiError(400, "an assistant message's 'tool_calls' must be a list", "messages")
            if content is None and calls:
                content = ""
            if not isinstance(content, str):
                raise ApiError(400, "each message needs a string 'content'", "messages")
            one = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
            if calls:
                one["tool_calls"] = calls
            if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
                one["tool_call_id"] = m["tool_call_id"]
            clean.append(one)
        if self._chat is None:
            from qwc.chat_template import ChatTemplate

            try:
                self._chat = ChatTemplate(self.engine.model.chat_template)
            except QwcError as e:
                raise ApiError(400, f"{e}; use /v1/completions", "messages") from None
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
            raise ApiError(400, "'chat_template_kwargs' must be an object of template variables "
                                "(e.g. {\"enable_thinking\": false})", "chat_template_kwargs")
        kwargs = {**self.settings.template_variables,
                  **{k: v for k, v in kwargs.items() if k not in ("messages", "tools", "add_generation_prompt")}}
        try:
            if self._chat.knows_tools:
                text = self._chat.render(template_messages(clean), tools=[{"type": "function", "function": f}
                                                                          for f in fns] or None, **kwargs)
            else:
                text = self._chat.render(fallback_messages(clean, fns), **kwargs)
        except ToolError as e:
            raise ApiError(400, str(e), e.param) from None
        except QwcError as e:
            raise ApiError(400, str(e), "messages") from None
        return self.encode_text(text, "messages"), text

    def chat_tokens(self, body: dict) -> list[int]:
        """The prompt a chat request's `messages` make (the model's template applied)."""
        return self._chat_prompt(body, [])[0]

    def _reasoning(self, body: dict, prompt_text: str) -> bool | None:
        """How the reply's thinking is split off: None (not: the template has no think block,
        the prompt closed an empty one, as Qwen3's enable_thinking false does, or the format is
        none), else whether the reply begins inside the block."""
        from .reasoning import FORMATS, closes_thinking, opens_thinking, template_thinks

        fmt = body.get("reasoning_format", self.settings.reasoning_format)
        if fmt not in FORMATS:
            raise ApiError(400, f"'reasoning_format' must be one of {', '.join(FORMATS)}, not {fmt!r}",
                           "reasoning_format")
        if fmt == "none" or not template_thinks(self.engine.model.chat_template) or closes_thinking(prompt_text):
            return None
        return opens_thinking(prompt_text)

    def encode_text(self, text: str, param: str) -> list[int]:
        """`text` as token ids; an empty encoding or a tokenizer error is a 400 naming `param`."""
        try:
            ids = self.engine.encode(text)
        except QwcError as e:
            raise ApiError(400, str(e), param) from None
        if not ids:
            raise ApiError(400, f"'{param}' encodes to no tokens", param)
        return ids

    def submit(self, reqs: list[Request], emit) -> None:
        """Queue the replies, `emit(i, kind, value)` for reply i's events; all or none of them
        (a full queue cancels those already queued)."""
        done: list[Request] = []
        try:
            for i, req in enumerate(reqs):
                req.emit = functools.partial(emit, i)
                done.append(self.scheduler.submit(req))
        except (QueueFull, QwcError) as e:
            for r in done:
                r.cancel()
            if isinstance(e, QueueFull):
                raise ApiError(503, f"{e}; retry later", code="server_overloaded", kind="server_error") from None
            raise ApiError(400, str(e)) from None


def chat_page() -> str:
    """The chat page served at / (runtime/chat_page.html): one self-contained file."""
    from importlib.resources import files

    return files(__package__).joinpath("chat_page.html").read_text(encoding="utf-8")


def create_app(engine, scheduler: Scheduler, settings: Settings):
    """The FastAPI application (needs the `serve` extra)."""
    try:
        from fastapi import FastAPI
        from fastapi import Request as HttpRequest
        from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
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

    if settings.webui:
        page = chat_page()

        @app.get("/")
        async def chat():   # no key: the page asks for one where the /v1 routes need it
            return HTMLResponse(page)

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

    @app.post("/tokenize")
    async def tokenize(request: HttpRequest):
        api.check_key(request.headers.get("authorization"))
        return server_info.tokenize(api, server_info.checked_json(await request.body(), ApiError), ApiError)

    @app.post("/detokenize")
    async def detokenize(request: HttpRequest):
        api.check_key(request.headers.get("authorization"))
        return server_info.detokenize(api, server_info.checked_json(await request.body(), ApiError), ApiError)

    @app.get("/props")
    async def props(request: HttpRequest):
        api.check_key(request.headers.get("authorization"))
        return server_info.props(api)

    @app.get("/slots")
    async def slots(request: HttpRequest):
        api.check_key(request.headers.get("authorization"))
        return server_info.slots(api)

    async def complete(request: HttpRequest, chat: bool):
        api.check_key(request.headers.get("authorization"))
        reqs, opts = api.parse(await request.body(), chat)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        api.submit(reqs, lambda i, kind, value: loop.call_soon_threadsafe(events.put_nowait, (i, kind, value)))
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        shape = _Shape(rid, opts["model"], chat, reqs[0].logprobs,
                       api.token_vocab if reqs[0].logprobs is not None else None, len(opts["echo"] or ""),
                       opts["tools"], opts.get("reasoning"))
        metrics.request_started()
        reply = _Reply(reqs, opts, shape, chat, metrics, events.get, request.is_disconnected)
        if opts["stream"]:
            return StreamingResponse(reply.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        status, body = await reply.whole()
        return JSONResponse(body, status_code=status)

    @app.post("/v1/embeddings")
    async def embeddings(request: HttpRequest):
        api.check_key(request.headers.get("authorization"))
        job, fixed = embedding_requests.job(api, server_info.checked_json(await request.body(), ApiError), ApiError)
        try:
            scheduler.submit_embedding(job)
        except QueueFull as e:
            raise ApiError(503, f"{e}; retry later", code="server_overloaded", kind="server_error") from None
        except QwcError as e:
            raise ApiError(400, str(e), "input") from None
        try:
            while not await asyncio.to_thread(job.done.wait, 1.0):
                if await request.is_disconnected():
                    job.cancelled.set()
        except asyncio.CancelledError:
            job.cancelled.set()
            raise
        if job.error is not None:
            raise ApiError(500, f"the embedding failed: {job.error}", kind="server_error")
        metrics.embeddings_done(job.tokens)
        # a Response, not a dict: FastAPI's encoder walks a dict's every float, seconds for a batch
        return JSONResponse(embedding_requests.reply(job, fixed))

    @app.post("/v1/completions")
    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    return app


class _Reply:
    """One completion request's replies on their way back to the client: their events from the
    scheduler (`next_event`: (reply index, kind, value)), as one JSON body or as server-sent
    events, and the client's presence (`disconnected`), polled so a client that went away
    cancels its requests."""

    def __init__(self, reqs: list[Request], opts: dict, shape: "_Shape", chat: bool, metrics,
                 next_event, disconnected):
        self.reqs, self.opts, self.shape, self.chat, self.metrics = reqs, opts, shape, chat, metrics
        self.next_event, self.disconnected = next_event, disconnected
        self.watcher = asyncio.create_task(self._watch())

    def cancel(self) -> None:
        for r in self.reqs:
            r.cancel()

    async def _watch(self) -> None:
        # a task of its own: a timeout on every token's wait cost the event loop a task per
        # token, CPU the decode threads want
        while any(r.finish_reason is None for r in self.reqs):
            await asyncio.sleep(0.5)
            if await self.disconnected():
                self.cancel()
                return

    async def stream(self):
        """The server-sent events, up to `data: [DONE]`."""
        reqs, opts, shape, chat, n = self.reqs, self.opts, self.shape, self.chat, len(self.reqs)
        done, lps, left, outcome = False, [[] for _ in reqs], n, None
        calls = [CallStream() for _ in reqs] if opts["tools"] else None   # hold back <tool_call>s
        thinking = None if opts.get("reasoning") is None else [ReasoningStream(opts["reasoning"]) for _ in reqs]
        try:
            for i in range(n):
                if chat:
                    yield _sse(shape.chunk({"role": "assistant", "content": ""}, None, index=i))
                elif opts["echo"] is not None:
                    yield _sse(shape.chunk(opts["echo"], None, index=i))
            while left:
                i, kind, value = await self.next_event()
                if kind == "logprob":
                    lps[i].append(value)
                    continue
                if kind == "text":
                    thought = ""
                    if thinking:
                        thought, value = thinking[i].feed(value)
                    chunks = self._text_chunks(i, thought, value, calls, lps[i])
                    for chunk in chunks:
                        yield _sse(chunk)
                    if chunks:   # (logprobs of text held back go with the chunk that shows it)
                        lps[i] = []
                    continue
                left -= 1
                if value.startswith("error"):   # the other replies end with it
                    self.cancel()
                    outcome = value
                    yield _sse(ApiError(500, value, kind="server_error").body())
                    break
                if value != "cancelled" and thinking:
                    chunks = self._text_chunks(i, *thinking[i].finish(), calls, lps[i])
                    for chunk in chunks:
                        yield _sse(chunk)
                    if chunks:
                        lps[i] = []
                if value != "cancelled" and calls:
                    chunks, value = self._tool_calls(calls[i], i, value)
                    for chunk in chunks:
                        yield _sse(chunk)
                if value != "cancelled":
                    yield _sse(shape.chunk({} if chat else "", value, lps[i], i))
            done = True
            if outcome is None:
                outcome = reqs[0].finish_reason
                if opts["include_usage"]:
                    yield _sse(shape.usage_chunk(reqs))
            yield "data: [DONE]\n\n"
            self.metrics.request_done(outcome, 200, reqs)
        finally:
            self.watcher.cancel()
            if not done:          # the client went away mid-stream
                self.cancel()
                self.metrics.request_done("cancelled", 499, reqs)

    def _text_chunks(self, i: int, thought: str, text: str, calls, lps: list) -> list[dict]:
        """Reply i's chunks of a piece: its reasoning (reasoning_content), then its text
        (content, less what the tool-call parser holds back); a reply that thinks sends no
        empty content chunk, so a client sees the thinking first."""
        if not self.chat:
            return [self.shape.chunk(text, None, lps, i)]
        out = [self.shape.chunk({"reasoning_content": thought}, None, lps, i)] if thought else []
        if calls:
            text = calls[i].feed(text)
        if text or (not out and self.shape.reasoning is None):
            out.append(self.shape.chunk({"content": text}, None, [] if out else lps, i))
        return out

    def _tool_calls(self, calls: CallStream, i: int, finish: str) -> tuple[list[dict], str]:
        """At reply i's end: the chunks of the text its tool-call parser held back and of the
        calls it found, and the reply's finish reason ("tool_calls" where it found any)."""
        rest, made = calls.finish()
        chunks = [self.shape.chunk({"content": rest}, None, index=i)] if rest else []
        if made:
            chunks.append(self.shape.chunk({"tool_calls": [dict(c, index=k) for k, c in enumerate(made)]},
                                           None, index=i))
            finish = "tool_calls"
        return chunks, finish

    async def whole(self) -> tuple[int, dict]:
        """The HTTP status and body of the replies, once all have ended."""
        reqs, opts, n = self.reqs, self.opts, len(self.reqs)
        texts, lps, finish = [[opts["echo"] or ""] for _ in reqs], [[] for _ in reqs], [None] * n
        try:
            while None in finish:
                i, kind, value = await self.next_event()
                if kind == "text":
                    texts[i].append(value)
                elif kind == "logprob":
                    lps[i].append(value)
                else:
                    finish[i] = value
                    if value.startswith("error"):
                        break
        finally:
            self.watcher.cancel()
            if any(r.finish_reason is None for r in reqs):
                self.cancel()
        err = next((f for f in finish if f and f.startswith("error")), None)
        if err:
            self.metrics.request_done(err, 500, reqs)
            return 500, ApiError(500, err, kind="server_error").body()
        self.metrics.request_done(finish[0], 200, reqs)
        return 200, self.shape.whole(["".join(t) for t in texts], finish, reqs, lps)


# Characters JSON may hold raw that str.splitlines() (httpx's aiter_lines, many SSE readers)
# takes for line ends: escaped, so an event is one line for every client. A random-weight
# model wrote them in the soak's JSON replies, and its client read broken events.
_LINE_ENDS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False).translate(_LINE_ENDS)}\n\n"


class _Shape:
    """OpenAI's reply objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool, top: int | None = None, vocab=None, offset: int = 0,
                 tools: bool = False, reasoning: bool | None = None):
        self.rid, self.model, self.chat, self.created = rid, model, chat, int(time.time())
        self.tools = tools                    # the replies' <tool_call>s become tool_calls
        self.reasoning = reasoning            # Api._reasoning: None, or whether replies begin thinking
        self.top, self.vocab = top, vocab     # logprobs: how many alternatives; the token bytes' source
        self.start = offset                   # completions' text_offset: characters before the next token,
        self.offsets: dict[int, int] = {}     # per reply

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, lps: list, index: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat's {"content": [...]}, or the legacy
        completions form (tokens, token_logprobs, top_logprobs, text_offset)."""
        if self.top is None:
            return None
        vocab = self.vocab()

        def token(i: int) -> tuple[str, bytes]:
            b = vocab.token_bytes(i)
            return b.decode("utf-8", errors="replace"), b

        if self.chat:
            content = []
            for tok, lp, best in lps:
                s, b = token(tok)
                alts = [{"token": (t := token(i))[0], "logprob": x, "bytes": list(t[1])} for i, x in best]
                content.append({"token": s, "logprob": lp, "bytes": list(b), "top_logprobs": alts})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, lp, best in lps:
            s = token(tok)[0]
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({token(i)[0]: x for i, x in best})
            at = self.offsets.get(index, self.start)
            out["text_offset"].append(at)
            self.offsets[index] = at + len(s)
        return out

    def chunk(self, delta, finish: str | None, lps: list = (), index: int = 0) -> dict:
        lp = self.logprobs(list(lps), index) if lps else None
        if self.chat:
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}]}

    @staticmethod
    def usage(reqs: list[Request]) -> dict:
        n, m = len(reqs[0].prompt), sum(len(r.generated) for r in reqs)   # the prompt counts once
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": reqs[0].cached_tokens}}   # OpenAI's prompt-cache field

    def usage_chunk(self, reqs: list[Request]) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(reqs)}

    def whole(self, texts: list[str], finish: list[str], reqs: list[Request], lps: list[list]) -> dict:
        if self.chat:
            choices = []
            for i, (t, f, lp) in enumerate(zip(texts, finish, lps)):
                message = {"role": "assistant", "content": t}
                if self.reasoning is not None:
                    thought, message["content"] = split_reasoning(t, self.reasoning)
                    if thought is not None:
                        message["reasoning_content"] = thought
                    t = message["content"]
                if self.tools:
                    message["content"], calls = split_calls(t)
                    if calls:
                        message["tool_calls"], f = calls, "tool_calls"
                choices.append({"index": i, "message": message, "logprobs": self.logprobs(lp, i), "finish_reason": f})
            return {**self._head("chat.completion"), "choices": choices, "usage": self.usage(reqs)}
        choices = [{"index": i, "text": t, "logprobs": self.logprobs(lp, i), "finish_reason": f}
                   for i, (t, f, lp) in enumerate(zip(texts, finish, lps))]
        return {**self._head("text_completion"), "choices": choices, "usage": self.usage(reqs)}
