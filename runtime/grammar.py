"""Constrained decoding and token bytes: the artifact's tokenizer as llguidance sees it.

A grammar (OpenAI's response_format json_object / json_schema, llama-server's GBNF `grammar`)
becomes a token mask at every step, computed by llguidance (a maintained grammar engine: its
JSON-schema compiler, its Earley parser over the tokenizer's byte trie). The sampler applies
the mask; the mask for the next token is computed on a worker thread (llguidance releases the
GIL) as soon as a token is chosen, so it overlaps the decode step that makes the next logits.

llguidance is in the `serve` extra: the engine's core does not need it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from qwc.errors import QwcError

# Whitespace JSON may hold between tokens: enough for pretty-printing some levels deep.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,20}"


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise QwcError("constrained output and logprobs need the serve extra: pip install 'qwc[serve]'") from None
    return llguidance


class TokenVocab:
    """The tokenizer once, for every request: llguidance's view of it (~0.4 s to build, so
    made on first use), each token's bytes, and the masks' worker."""

    def __init__(self, tokenizer, vocab_size: int, eos: set[int], limit: int | None = None):
        if tokenizer is None:
            raise QwcError("the artifact has no tokenizer: constrained output needs one")
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos)
        self.limit = limit or vocab_size        # ids past it are never sampled (qwc/vocab.py)
        self._ll = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qwc-grammar")
        self._bytes: dict[int, bytes] = {}

    @property
    def ll(self):
        with self._lock:
            if self._ll is None:
                llg = _llguidance()
                # llguidance takes as EOS only ids its tokenizer holds; a config may name one past
                # them (ids up to vocab_size are text-less there). The ending a finished grammar
                # allows is the model's own EOS either way (GrammarState.consume).
                held = self.tokenizer.get_vocab_size(with_added_tokens=True)
                eos = [e for e in self.eos if e < held]
                try:
                    self._ll = llg.LLTokenizer(self.tokenizer.to_str(), n_vocab=max(self.vocab_size, held),
                                               eos_token=eos or None)
                except (ValueError, RuntimeError, TypeError) as e:
                    raise QwcError(f"the tokenizer cannot give token bytes ({str(e).splitlines()[0]})") from None
            return self._ll

    def single_token(self, text: str) -> int | None:
        """The id of the token that is `text` by itself (an added token such as Qwen3's
        <think>), or None."""
        tok = self.tokenizer.token_to_id(text)
        return tok if tok is not None and tok < self.limit else None

    def marker(self, text: str) -> str:
        """`text` as a Lark grammar's literal: as its token where it is a token of its own
        (llguidance takes added tokens as special, which no string literal matches), else
        the string."""
        import json

        tok = self.single_token(text)
        return f"<[{tok}]>" if tok is not None else json.dumps(text)

    def token_bytes(self, tok: int) -> bytes:
        """The bytes a token stands for (a byte-level token may hold part of a character)."""
        b = self._bytes.get(tok)
        if b is None:
            b = self._bytes[tok] = self.ll.decode_bytes([tok])
        return b

    # -- grammars ----------------------------------------------------------------------
    @staticmethod
    def json_grammar(schema: dict | None) -> str:
        """A grammar for JSON that validates against `schema` (None: any JSON object). Runs of
        whitespace between tokens are bounded (JSON_WHITESPACE), so sampling cannot wander
        into whitespace for ever; a schema's own "x-guidance" options override that."""
        llg = _llguidance()
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                          defaults={"whitespace_pattern": JSON_WHITESPACE})
        except (ValueError, TypeError) as e:
            raise QwcError(f"the JSON schema cannot be used: {e}") from None

    @staticmethod
    def gbnf_grammar(gbnf: str) -> str:
        """A grammar from llama.cpp's GBNF text (llama-server's `grammar` field)."""
        llg = _llguidance()
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(gbnf))
        except Exception as e:   # the converter raises plain exceptions on bad GBNF
            raise QwcError(f"the GBNF grammar cannot be read: {str(e).splitlines()[0] if str(e) else e!r}") from None

    def check(self, grammar: str, what: str = "the grammar") -> None:
        """Raise QwcError naming the problem if `grammar` cannot constrain this tokenizer."""
        llg = _llguidance()
        err = llg.LLMatcher.validate_grammar(grammar, self.ll)
        if err:
            raise QwcError(f"{what} cannot be used: {err.splitlines()[0]}")

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(self, grammar)


class Constraint:
    """One request's grammar state: the allowed next tokens, and the tokens consumed so far.
    `allowed()` waits for the mask the worker computes after each `consume`."""

    def __init__(self, vocab: TokenVocab, grammar: str):
        llg = _llguidance()
        self.vocab = vocab
        self.m = llg.LLMatcher(vocab.ll, grammar, log_level=0)
        if self.m.is_error():
            raise QwcError(f"the grammar cannot be used: {self.m.get_error().splitlines()[0]}")
        self._words = np.empty((vocab.vocab_size + 31) // 32, np.int32)
        self.mask_s = self.wait_s = 0.0     # seconds computing masks (worker), waiting for them (sampler)
        self._stopped = False               # read at consume: the matcher is the worker's while it computes
        self._next: Future = vocab._pool.submit(self._mask)

    def _mask(self) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            return self._compute()
        finally:
            self.mask_s += time.perf_counter() - t0

    def _compute(self) -> np.ndarray:
        self.m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self.m.is_error():
            raise QwcError(f"grammar: {self.m.get_error().splitlines()[0]}")
        return np.unpackbits(self._words.view(np.uint8), count=self.vocab.limit, bitorder="little").view(bool)

    def allowed(self) -> np.ndarray:
        """A boolean per sampleable id: may it come next?"""
        t0 = time.perf_counter()
        try:
            return self._next.result()
        finally:
            self.wait_s += time.perf_counter() - t0

    def consume(self, tok: int) -> None:
        """Take the chosen token and start computing the next mask."""
        if not self.m.consume_token(tok):
            raise QwcError(f"grammar: token {tok} was not allowed ({self.m.get_error().splitlines()[0]})")
        self._stopped = self.m.is_stopped()
        if not self._stopped:
            self._next = self.vocab._pool.submit(self._mask)
        else:   # the grammar is complete: only an end-of-sequence token may follow
            done = np.zeros(self.vocab.limit, bool)
            done[[e for e in self.vocab.eos if e < self.vocab.limit]] = True
            self._next = Future()
            self._next.set_result(done)

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but an end token may follow."""
        return self._stopped


def response_format_grammar(fmt, vocab: TokenVocab) -> str | None:
    """OpenAI's `response_format` as a grammar (None for plain text); QwcError naming what is
    wrong with it."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise QwcError("'response_format' must be an object whose 'type' is text, json_object or json_schema")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        grammar = vocab.json_grammar(None)
    else:
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise QwcError("'response_format': json_schema needs a 'json_schema' object with a 'name'")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise QwcError("'response_format': json_schema.schema must be a JSON Schema object")
        grammar = vocab.json_grammar(schema)
    vocab.check(grammar, "'response_format': the JSON schema")
    return grammar
