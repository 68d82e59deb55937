"""`qwc serve`'s POST /v1/embeddings: OpenAI's request and response shapes around the
scheduler's embedding jobs (runtime/embeddings.py).

The request: `input` (a string, a list of strings, a list of token ids, or a list of lists of
them; at most MAX_INPUTS, none empty, each within the context), `model` (the base or an
adapter, as the completions' routes take it), `encoding_format` ("float" or "base64": the
vector's little-endian float32 bytes, as OpenAI's client decodes them), `dimensions` (the first
N components, normalized again: the Matryoshka truncation Qwen3-Embedding is trained for) and
qwc's own `pooling` (over the server's --pooling). The response: {"object": "list", "data":
[{"object": "embedding", "index", "embedding"}], "model", "usage"}. Bad input is a 400 naming
the field."""

from __future__ import annotations

import base64

import numpy as np

from .embeddings import POOLINGS, EmbeddingJob, normalized

MAX_INPUTS = 2048   # OpenAI's bound on one request's inputs


def job(api, body: dict, error) -> tuple[EmbeddingJob, dict]:
    """The validated job (not yet submitted) and the reply's fixed fields."""
    eng = api.engine
    if not eng.embeds:
        raise error(400, "this artifact has no embed entry point: compile it with `qwc compile --embeddings` to "
                         "serve embeddings", "model", "embeddings_unsupported")
    model = body.get("model", api.settings.model_id)
    adapter = api.adapter_slot(model)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise error(400, f"'encoding_format' must be 'float' or 'base64', not {fmt!r}", "encoding_format")
    pooling = body.get("pooling", api.settings.pooling)
    if pooling not in POOLINGS:
        raise error(400, f"'pooling' must be one of {', '.join(POOLINGS)}", "pooling")
    hidden = eng.model.hidden_size
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= hidden):
        raise error(400, f"'dimensions' must be an integer from 1 to the model's {hidden}", "dimensions")
    inputs = _token_lists(api, body.get("input"), error)
    return (EmbeddingJob(inputs, pooling, adapter),
            {"model": model, "encoding_format": fmt, "dimensions": dims})


def _token_lists(api, value, error) -> list[list[int]]:
    """`input` as token ids, one list an input."""
    eng = api.engine
    if isinstance(value, str) or (isinstance(value, list) and value and _is_ids(value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise error(400, "'input' must be a non-empty string, list of strings, list of token ids or list of them",
                    "input")
    if len(value) > MAX_INPUTS:
        raise error(400, f"'input' has {len(value)} items; one request takes at most {MAX_INPUTS}", "input")
    out = []
    for i, x in enumerate(value):
        if isinstance(x, str):
            if not x:
                raise error(400, f"input {i} is an empty string", "input")
            if eng.tokenizer is None:
                raise error(400, "this artifact has no tokenizer: give token ids", "input")
            ids = api.encode_text(x, "input")
        elif isinstance(x, list) and x and _is_ids(x):
            bad = next((t for t in x if not 0 <= t < eng.vocab_size), None)
            if bad is not None:
                raise error(400, f"input {i}: token id {bad} is outside the vocabulary [0, {eng.vocab_size})", "input")
            ids = list(x)
        else:
            raise error(400, f"input {i} must be a non-empty string or list of token ids", "input")
        if len(ids) > eng.ctx:
            raise error(400, f"input {i} has {len(ids)} tokens; the context holds {eng.ctx}", "input",
                        "context_length_exceeded")
        out.append(ids)
    return out


def _is_ids(x: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def reply(job: EmbeddingJob, fixed: dict) -> dict:
    """OpenAI's response for a finished job."""
    vectors = job.vectors
    if fixed["dimensions"] is not None:
        vectors = np.stack([normalized(v[:fixed["dimensions"]]) for v in vectors])
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, fixed["encoding_format"])}
            for i, v in enumerate(vectors)]
    n = job.tokens
    return {"object": "list", "data": data, "model": fixed["model"],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def _encoded(v: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]
