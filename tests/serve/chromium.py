"""Headless Chromium driven through its DevTools protocol, for the chat page's browser test.

Debian's `chromium` package (scripts/browser/setup.sh installs it where it is missing); the
protocol over a WebSocket with the `websockets` package the server extra brings. Nothing is
downloaded at run time."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "browser" / "setup.sh"


def chromium_path() -> str:
    """Debian's chromium, installed first where it is missing."""
    found = shutil.which("chromium")
    if found is None:
        subprocess.run(["bash", str(SETUP)], check=True)
        found = shutil.which("chromium")
    assert found, "scripts/browser/setup.sh did not install chromium"
    return found


class Browser:
    """One headless Chromium with one page; `events` keeps what the page reported (exceptions
    thrown, console calls)."""

    def __init__(self, profile: Path, width: int = 1100, height: int = 760):
        self.proc = subprocess.Popen([chromium_path(), "--headless=new", "--no-sandbox", "--disable-gpu",
                                      "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"   # chromium writes its port here once listening
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise AssertionError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.ids = itertools.count(1)
        self.events: list[dict] = []
        self.call("Runtime.enable")
        self.call("Page.enable")

    def call(self, method: str, **params) -> dict:
        """One protocol command's result; events that arrive meanwhile are kept."""
        n = next(self.ids)
        self.ws.send(json.dumps({"id": n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == n:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def evaluate(self, expression: str):
        """The page's value of a JavaScript expression (a promise awaited)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60):
        """The expression's first truthy value, polled."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.evaluate(expression)
            if v:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression}")
            time.sleep(0.05)

    def open(self, url: str) -> None:
        """`url` navigated to and loaded: until then `document` may still be about:blank's or
        have no body, and an expression that reads the page would throw."""
        self.call("Page.navigate", url=url)
        self.wait_for(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")

    def type(self, text: str) -> None:
        """Text typed into the focused element, as an input method would put it."""
        self.call("Input.insertText", text=text)

    def press_enter(self, shift: bool = False) -> None:
        """The Enter key, down and up, with Shift held or not."""
        key = dict(key="Enter", code="Enter", windowsVirtualKeyCode=13, nativeVirtualKeyCode=13,
                   modifiers=8 if shift else 0)
        self.call("Input.dispatchKeyEvent", type="keyDown", text="\r", **key)
        self.call("Input.dispatchKeyEvent", type="keyUp", **key)

    def click(self, selector: str) -> None:
        """A mouse click at the middle of the element `selector` names."""
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self, path: Path) -> bytes:
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(png)
        return png

    def errors(self) -> list[str]:
        """Exceptions the page threw and console errors it logged."""
        out = [e["params"]["exceptionDetails"].get("text", "") for e in self.events
               if e["method"] == "Runtime.exceptionThrown"]
        return out + [" ".join(str(a.get("value", "")) for a in e["params"]["args"]) for e in self.events
                      if e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] == "error"]

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
