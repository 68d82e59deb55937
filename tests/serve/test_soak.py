"""bench/soak.py's judges: of a structured reply (the soak counts a reply it refuses as failed),
valid JSON of the schema passes, as the content or as every tool call's arguments, anything
else is named; of memory, growth is peak to peak after the warm-up."""

import json

from qwc.bench.soak import SCHEMA, rss_growth, structured_problem

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


def test_memory_growth_ignores_the_warm_up_and_compares_peaks():
    ramp = [(t, 600 + t) for t in range(0, 120, 2)]                     # the warm-up: +120 MiB
    flat = [(t, 800 + 30 * (t % 20 == 0)) for t in range(120, 720, 2)]  # a batch's highs come and go
    r = rss_growth(ramp + flat, 120)
    assert r["rss_after_warmup_mib"] == 830 and r["rss_peak_first_half_mib"] == r["rss_peak_second_half_mib"] == 830
    assert r["rss_growth"] == 0 and abs(r["rss_slope_mib_per_min"]) < 0.5
    leak = [(t, 800 + t / 60) for t in range(120, 720, 2)]               # 1 MiB a minute
    r = rss_growth(ramp + leak, 120)
    assert 0.005 < r["rss_growth"] < 0.01 and abs(r["rss_slope_mib_per_min"] - 1) < 1e-6
