"""Tool calling in Qwen2.5's format (the Hermes convention it is trained on): the tools go into
the prompt, the model answers a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
and a tool's result comes back as a `<tool_response>` in a user turn.

The model's own chat template renders tools where it knows them (Qwen2.5's does: `tools` and
`tool_calls` in its Jinja). A template without them (SmolLM2's) gets the same convention from
`fallback_messages`: a system message listing the tools, earlier calls written back as
`<tool_call>` text, results as `<tool_response>` user turns. `tool_choice` "required" or a named
function constrains the reply to one call whose arguments follow the function's JSON schema
(a grammar for runtime/grammar.py).
"""

from __future__ import annotations

import json
import re
import secrets

from qwc.errors import QwcError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for function names
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ToolError(QwcError):
    """A bad `tools`, `tool_choice` or tool message; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_tools(tools, choice) -> tuple[list[dict], str | None]:
    """The request's functions ({"name", "description", "parameters"}) and what the reply must
    be: None (auto: text or calls), "none" (no tools offered), "required" (a call), or a
    function's name (a call of it)."""
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return [], "none"
    if not isinstance(tools, list) or len(tools) > 128:
        raise ToolError("'tools' must be a list of at most 128 functions", "tools")
    fns = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
            raise ToolError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}} with a name "
                            "of letters, digits, _ or - (at most 64)", "tools")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or not isinstance(f.get("description", ""), str):
            raise ToolError(f"tool {f['name']!r}: 'parameters' must be a JSON Schema object and 'description' a "
                            "string", "tools")
        fns.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    if len({f["name"] for f in fns}) != len(fns):
        raise ToolError("'tools' names a function twice", "tools")
    if choice in (None, "auto"):
        return fns, None
    if choice in ("none", "required"):
        return fns, choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        else None
    if not isinstance(name, str):
        raise ToolError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if name not in {f["name"] for f in fns}:
        raise ToolError(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    return fns, name


def call_schema(fns: list[dict], name: str | None = None) -> dict:
    """The JSON schema of one call: {"name": one of the functions, "arguments": its parameters}."""
    one = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}
           for f in fns if name in (None, f["name"])]
    return one[0] if len(one) == 1 else {"anyOf": one}


def call_grammar(fns: list[dict], name: str | None = None, vocab=None) -> str:
    """A Lark grammar (llguidance's, with its %json rule) for exactly one call; `vocab`
    (runtime/grammar.py: TokenVocab) names a marker that is a token of its own (Qwen's
    <tool_call>) as that token."""
    def marker(s: str) -> str:
        return vocab.marker(s) if vocab is not None else json.dumps(s)

    from .grammar import JSON_WHITESPACE

    # whitespace between the call's tokens bounded as in response_format's JSON: unbounded, a
    # model can wander into it for ever
    schema = {**call_schema(fns, name), "x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    return (f"start: {marker(OPEN)} {json.dumps(chr(10))} call {json.dumps(chr(10))} {marker(CLOSE)}\n"
            f"call: %json {json.dumps(schema)}\n")


def _arguments(call: dict) -> dict:
    """An assistant message's call as the template wants it: arguments as an object (OpenAI
    sends them as a JSON string)."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ToolError("each of an assistant message's 'tool_calls' needs a 'function' with a 'name'", "messages")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise ToolError(f"the arguments of a call of {f['name']!r} are not JSON", "messages") from None
    return {"name": f["name"], "arguments": args}


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a template that knows tools (HF's convention: tool_calls' arguments as
    objects, tool results as role "tool")."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "function": _arguments(c)} for c in m["tool_calls"]]
        out.append(m)
    return out


def fallback_messages(messages: list[dict], fns: list[dict]) -> list[dict]:
    """Messages with the tool convention written out, for a template without tools."""
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in fns)
    guide = ("You can call functions to help with the user's request. They are listed, one JSON "
             f"object each, between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n\nTo call one, "
             f"answer with a JSON object of its name and arguments between {OPEN} and {CLOSE}:\n"
             f'{OPEN}\n{{"name": "function name", "arguments": {{...}}}}\n{CLOSE}')
    out, rest = [], list(messages)
    if fns:
        if rest and rest[0]["role"] == "system":
            out.append({"role": "system", "content": f"{rest.pop(0)['content']}\n\n{guide}"})
        else:
            out.append({"role": "system", "content": guide})
    for m in rest:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps(_arguments(c), ensure_ascii=False)}\n{CLOSE}"
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(x for x in (m.get("content") or "", calls) if x)})
        else:
            out.append(m)
    return out


def split_calls(text: str) -> tuple[str | None, list[dict]]:
    """The reply's text without its calls (None if nothing else), and OpenAI's tool_calls for
    every well-formed `<tool_call>` block (a malformed one stays in the text)."""
    calls, kept, last = [], [], 0
    for m in _CALL.finditer(text):
        try:
            call = json.loads(m[1])
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}})
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class CallStream:
    """A streamed reply's text, held back from where a `<tool_call>` may begin: what comes
    before is content as it arrives, the rest is parsed at the end (split_calls)."""

    def __init__(self):
        self.text, self.shown, self.calling = "", 0, False

    def feed(self, piece: str) -> str:
        """The piece's text that is content for sure."""
        self.text += piece
        if self.calling:
            return ""
        at = self.text.find(OPEN, self.shown)
        if at >= 0:
            self.calling = True
            end = at
        else:
            end = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.shown), 0, -1):
                if self.text.endswith(OPEN[:k]):
                    end -= k
                    break
        out, self.shown = self.text[self.shown:end], max(self.shown, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not yet shown, and the calls."""
        rest = self.text[self.shown:]
        content, calls = split_calls(rest)
        return (content or "") if calls else rest, calls
