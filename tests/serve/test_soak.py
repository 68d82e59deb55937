"""bench/soak.py's check of a structured reply (the soak counts a reply it refuses as failed):
valid JSON of the schema passes, as the content or as every tool call's arguments; anything
else is named."""

import json

from soak import SCHEMA, structured_problem  # bench/soak.py

SCHEMA_BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
TOOL_BODY = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]}
GOOD = json.dumps({"city": "Paris", "days": 3})


def _call(name="get_weather", arguments=GOOD):
    return {0: {"name": name, "arguments": arguments}}


def test_a_valid_reply_or_tool_call_passes():
    assert structured_problem(SCHEMA_BODY, GOOD, {}, "stop") is None
    assert structured_problem(TOOL_BODY, "", _call(), "tool_calls") is None


def test_an_invalid_reply_or_tool_call_is_named():
    assert "invalid JSON" in structured_problem(SCHEMA_BODY, '{"city": "Paris"', {}, "stop")
    assert "invalid JSON" in structured_problem(SCHEMA_BODY, json.dumps({"city": "Paris", "days": 40}), {}, "stop")
    assert "invalid JSON" in structured_problem(SCHEMA_BODY, json.dumps({"city": "x" * 13, "days": 1}), {}, "stop")
    assert "invalid JSON" in structured_problem(TOOL_BODY, "", _call(arguments='{"days": 2}'), "tool_calls")
    assert "tool call of 'other'" in structured_problem(TOOL_BODY, "", _call(name="other"), "tool_calls")
    assert "finished 'stop' with 0 tool calls" in structured_problem(TOOL_BODY, GOOD, {}, "stop")
