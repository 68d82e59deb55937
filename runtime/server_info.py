"""`qwc serve`'s endpoints that describe the server rather than generate: /tokenize and
/detokenize (llama-server's request shapes, and vLLM's: `prompt` or chat `messages`), /props
(the context, the chat template, the model, the build) and /slots (what each sequence slot is
doing), with llama-server's field names where qwc has the thing they name.

A response carries both servers' keys where they differ (/tokenize: llama-server's `tokens`,
vLLM's `count` and `max_model_len`; /detokenize: `content` and vLLM's `prompt`), so either
server's client reads it. Bad input is a 400 in OpenAI's error shape, naming the field."""

from __future__ import annotations

from qwc import __version__

MAX_TEXT = 1 << 24      # characters /tokenize takes in one request
MAX_TOKENS = 1 << 22    # ids /detokenize takes in one request


def _flag(body: dict, name: str, default: bool, error) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise error(400, f"'{name}' must be true or false", name)
    return v


def tokenize(api, body: dict, error) -> dict:
    """{"tokens", "count", "max_model_len"}: llama-server's `content` (`add_special`, default
    false; `with_pieces`: each token as {"id", "piece"}, the piece a string where its bytes are
    UTF-8, else a list of bytes), or vLLM's `prompt` (`add_special_tokens`, default true) or
    `messages` (the chat template applied, as a chat request's prompt is)."""
    eng = api.engine
    if eng.tokenizer is None:
        raise error(400, "this artifact has no tokenizer", "content")
    with_pieces = _flag(body, "with_pieces", False, error)
    if "messages" in body:
        ids = api.chat_tokens(body)
    else:
        field = "content" if "content" in body or "prompt" not in body else "prompt"
        text = body.get(field)
        if not isinstance(text, str):
            raise error(400, f"'{field}' must be a string (or give 'messages')", field)
        if len(text) > MAX_TEXT:
            raise error(400, f"'{field}' has {len(text)} characters; /tokenize takes at most {MAX_TEXT}", field)
        special = _flag(body, "add_special", False, error) if field == "content" else _flag(
            body, "add_special_tokens", True, error)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise error(400, f"'{field}' is not valid UTF-8 text", field) from None
        ids = eng.tokenizer.encode(text, add_special_tokens=special).ids
    tokens = [{"id": t, "piece": _piece(api.token_vocab().token_bytes(t))} for t in ids] if with_pieces else ids
    return {"tokens": tokens, "count": len(ids), "max_model_len": eng.ctx}


def _piece(b: bytes):
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return list(b)


def detokenize(api, body: dict, error) -> dict:
    """{"content", "prompt"}: the text of `tokens` (special tokens as their text, as
    llama-server's); an id outside the vocabulary is refused, one in the rows past the tokenizer
    (a padded vocabulary's) stands for no text."""
    eng = api.engine
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise error(400, "'tokens' must be a list of token ids", "tokens")
    if len(ids) > MAX_TOKENS:
        raise error(400, f"'tokens' has {len(ids)} ids; /detokenize takes at most {MAX_TOKENS}", "tokens")
    bad = next((t for t in ids if not 0 <= t < eng.vocab_size), None)
    if bad is not None:
        raise error(400, f"token id {bad} is not in the vocabulary [0, {eng.vocab_size})", "tokens")
    if eng.tokenizer is None:
        raise error(400, "this artifact has no tokenizer", "tokens")
    try:
        text = eng.tokenizer.decode([t for t in ids if t < eng.sample_limit], skip_special_tokens=False)
    except Exception as e:   # tokenizers raises a bare Exception on ids it lacks
        raise error(400, f"the tokens cannot be decoded ({str(e).splitlines()[0] if str(e) else e!r})",
                    "tokens") from None
    return {"content": text, "prompt": text}


def _params(req) -> dict:
    """A request's sampling settings under llama-server's names (/slots' `params`)."""
    sp = req.sampling
    return {"n_predict": req.max_tokens, "max_tokens": req.max_tokens, "seed": sp.seed,
            "temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p,
            "repeat_penalty": sp.repetition_penalty, "presence_penalty": sp.presence_penalty,
            "frequency_penalty": sp.frequency_penalty, "ignore_eos": req.ignore_eos,
            "n_probs": req.logprobs or 0, "stop": [], "lora": [{"id": req.adapter - 1, "scale": 1.0}]
            if req.adapter else []}


def slots(api) -> list[dict]:
    """llama-server's /slots: a slot per sequence the server runs at once; qwc adds each slot's
    prompt and generated token counts and its adapter's name."""
    eng, names = api.engine, api.engine.adapters.names if api.engine.adapters is not None else []
    out = []
    for row, req, cached in api.scheduler.slot_states():
        slot = {"id": row, "id_task": -1 if req is None else id(req) & 0x7FFFFFFF, "n_ctx": eng.ctx,
                "speculative": api.scheduler.speculate is not None, "is_processing": req is not None,
                "params": {} if req is None else _params(req),
                "next_token": {"has_next_token": req is not None and req.finish_reason is None,
                               "has_new_line": False, "n_remain": -1 if req is None else
                               max(0, req.max_tokens - len(req.generated)),
                               "n_decoded": 0 if req is None else len(req.generated)},
                "n_prompt_tokens": cached if req is None else len(req.prompt),
                "n_prompt_tokens_cached": cached if req is None else req.cached_tokens,
                "adapter": None if req is None or not req.adapter else names[req.adapter - 1]}
        out.append(slot)
    return out


def props(api) -> dict:
    """llama-server's /props, for what qwc has."""
    eng, tok = api.engine, api.engine.tokenizer

    def text(ids):
        return tok.decode(list(ids)[:1], skip_special_tokens=False) if tok is not None and ids else ""

    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": eng.ctx, "speculative":
                                            api.scheduler.speculate is not None, "is_processing": False,
                                            "params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0,
                                                       "repeat_penalty": 1.0, "presence_penalty": 0.0,
                                                       "frequency_penalty": 0.0, "n_probs": 0, "stop": []},
                                            "prompt": ""},
            "total_slots": api.scheduler.max_running, "model_path": str(eng.path),
            "model": api.settings.model_id, "chat_template": eng.model.chat_template or "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"qwc {__version__}",
            "bos_token": text([eng.model.bos_token_id] if eng.model.bos_token_id is not None else []),
            "eos_token": text(sorted(eng.eos)), "n_vocab": eng.vocab_size,
            "target": eng.manifest.target.name, "is_sleeping": False}


def checked_json(raw: bytes, error) -> dict:
    """A request body as a JSON object, or `error`'s 400 (every endpoint's first check)."""
    import json

    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise error(400, "the request body must be a JSON object")
    return body

