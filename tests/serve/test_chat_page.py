"""The chat page `qwc serve` answers / with (runtime/chat_page.html), in a real browser: headless
Chromium (Debian's package, driven through its DevTools protocol: chromium.py) against `qwc
serve` on SmolLM2 with a LoRA adapter. A question typed and sent with Enter streams a reply that
names Paris; Shift+Enter breaks the line instead of sending; the adapter picker sends the
adapter's name, and its reply equals the API's for the same conversation; Regenerate asks again;
Stop ends a long reply and frees its slot; the page throws no error. The screenshot it saves is
the README's (QWC_SCREENSHOT=PATH keeps a copy)."""

from __future__ import annotations

import os
import shutil

import httpx
import openai
import pytest
from chromium import Browser
from test_serve import Server

from qwc.cli import main
from qwc.eval import data

pytestmark = [pytest.mark.realdata, pytest.mark.slow]

# asked for a sentence: the bare question's first word is a near tie under Q8_0 activations ("La"
# or "The", 0.06 apart in log-probability on an AMD Zen 4), and "La femme de France" names no city
QUESTION = "What is the capital of France? Answer in one sentence."
SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat_page")
    text = d / "pp.txt"
    text.write_text(data.novel("prideprejudice").read_text()[:20000])
    assert main(["-q", "lora", "smollm2", "--data", str(text), "-o", str(d / "austen"), "--steps", "2",
                 "--seq-len", "32", "--batch", "1", "--rank", "8", "--lr", "5e-2"]) == 0
    assert main(["-q", "export", "smollm2", "-o", str(d / "s.onnx")]) == 0
    assert main(["-q", "compile", str(d / "s.onnx"), "-o", str(d / "smol.qwc"), "--max-lora-rank", "8"]) == 0
    s = Server(d / "smol.qwc", "--max-batch", "2", "--lora", f"austen={d / 'austen'}")
    yield s
    s.close()


@pytest.fixture
def page(server, tmp_path):
    b = Browser(tmp_path / "profile")
    b.open(server.base + "/")
    b.wait_for("document.body.dataset.state === 'idle'")
    yield b
    b.close()


def _set(page, field: str, value: str) -> None:
    """A settings field filled as a user does: the value, then its change event (kept)."""
    page.evaluate(f"(() => {{ const e = document.getElementById('{field}'); e.value = {value!r}; "
                  "e.dispatchEvent(new Event('change')); })()")


def _ask(page, text: str) -> dict:
    """`text` typed into the message box and sent with Enter; the finished reply's label, thinking
    and text, the reply's lengths as it streamed, and the chunks it came in."""
    page.evaluate("document.getElementById('input').focus()")
    chunks = int(page.evaluate("document.body.dataset.chunks"))
    page.type(text)
    page.press_enter()
    page.wait_for("document.body.dataset.state === 'generating'")
    seen = []
    while page.evaluate("document.body.dataset.state") == "generating":
        seen.append(page.evaluate("document.querySelector('#log .msg.assistant:last-child .content').textContent.length"))
    assert page.evaluate("document.body.dataset.state") == "idle"
    last = "document.querySelector('#log .msg.assistant:last-child')"
    return {"who": page.evaluate(f"{last}.querySelector('.who').textContent"),
            "text": page.evaluate(f"{last}.querySelector('.content').textContent"),
            "lengths": seen, "chunks": int(page.evaluate("document.body.dataset.chunks")) - chunks}


def test_a_question_streams_a_reply_the_adapter_regenerate_and_stop(server, page, tmp_path):
    models = page.evaluate("[...document.querySelectorAll('#model option')].map(o => o.value)")
    assert models == ["smol", "austen"]
    page.click("#settings-toggle")
    _set(page, "system", SYSTEM)
    _set(page, "temperature", "0")
    _set(page, "max-tokens", "32")

    # Shift+Enter is a new line, not a send
    page.evaluate("document.getElementById('input').focus()")
    page.type("draft")
    page.press_enter(shift=True)
    assert page.evaluate("document.getElementById('input').value") == "draft\n"
    assert page.evaluate("document.querySelectorAll('#log .msg').length") == 0
    page.evaluate("document.getElementById('input').value = ''")

    first = _ask(page, QUESTION)
    assert first["who"] == "smol"
    assert first["chunks"] > 3 and len(set(first["lengths"])) > 1, first   # streamed, not one piece
    assert "tokens/s" in page.evaluate("document.getElementById('speed').textContent")
    assert "Paris" in first["text"], first
    # the reply is the API's for this conversation, word for word
    client = openai.OpenAI(base_url=server.url, api_key="unused")
    assert first["text"] == client.chat.completions.create(
        model="smol", temperature=0, max_tokens=32,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]).choices[0].message.content

    # the adapter: the page sends its name, and the reply is the API's for this conversation
    _set(page, "model", "austen")
    second = _ask(page, "And of Italy?")
    assert second["who"] == "austen"
    want = client.chat.completions.create(
        model="austen", temperature=0, max_tokens=32,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And of Italy?"}]).choices[0].message.content
    assert second["text"] == want

    page.click("#regenerate")   # at temperature 0, the same reply again, in the same place
    page.wait_for("document.body.dataset.state === 'idle'")
    assert page.evaluate("document.querySelectorAll('#log .msg.assistant').length") == 2
    assert page.evaluate("document.querySelector('#log .msg.assistant:last-child .content').textContent") == want

    shot = page.screenshot(tmp_path / "chat.png")
    assert shot.startswith(b"\x89PNG\r\n\x1a\n") and len(shot) > 10_000
    if os.environ.get("QWC_SCREENSHOT"):
        shutil.copy(tmp_path / "chat.png", os.environ["QWC_SCREENSHOT"])

    # Stop: a long reply ends where it is, and the server frees its slot
    _set(page, "max-tokens", "2000")
    page.evaluate("document.getElementById('input').focus()")
    page.type("Write a long story about a dragon.")
    page.press_enter()
    page.wait_for("document.querySelector('#log .msg.assistant:last-child .content').textContent.length > 0")
    page.click("#stop")
    page.wait_for("document.body.dataset.state === 'idle'", timeout=10)
    assert "Error" not in page.evaluate("document.querySelector('#log .msg.assistant:last-child').textContent")
    slots = None
    for _ in range(100):   # the server sees the client go within its poll
        slots = httpx.get(server.base + "/slots").json()
        if not any(s["is_processing"] for s in slots):
            break
        page.wait_for("true", timeout=1)
    assert not any(s["is_processing"] for s in slots), slots
    assert page.errors() == []
