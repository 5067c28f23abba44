"""Open a page in headless Chromium over the DevTools protocol (a pipe, no extra package) and report on it.

`open_page(path)` starts Chromium with ``--remote-debugging-pipe`` (messages are NUL-terminated JSON on file
descriptors 3 and 4), loads ``file://path`` in a fixed viewport, waits for the load event, and returns a
`PageReport`: the console errors and uncaught exceptions seen, what `PROBE` measured in the page (every image's
natural size, where the verdict is) and a PNG screenshot (the viewport, or the whole page).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
VIEWPORT = (1280, 800)

PROBE = """JSON.stringify({
  images: [...document.images].map(im => ({alt: im.alt, complete: im.complete, width: im.naturalWidth})),
  verdict: (() => { const el = document.getElementById("verdict");
    if (!el) return null;
    const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return {top: r.top, bottom: r.bottom, height: r.height, text: el.innerText,
            visible: s.display !== "none" && s.visibility !== "hidden" && r.height > 0}; })(),
  innerHeight: window.innerHeight,
  scrollHeight: document.documentElement.scrollHeight,
  scripts: document.scripts.length,
  external: [...document.querySelectorAll("[src],link[href]")].map(e => e.src || e.href)
    .filter(u => !u.startsWith("data:")),
})"""


def chromium_binary() -> str | None:
    """The first Chromium/Chrome binary on PATH, or None."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass(frozen=True)
class PageReport:
    errors: list[str]  # console errors, failed loads, uncaught exceptions
    probe: dict[str, Any]
    screenshot: bytes  # PNG


class _Pipe:
    def __init__(self, binary: str, profile: str) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def child_fds() -> None:  # Chromium reads commands on fd 3 and writes replies on fd 4
            read_end, write_end = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        width, height = VIEWPORT
        self.process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                "--no-first-run",
                "--disable-extensions",
                f"--window-size={width},{height}",
                f"--user-data-dir={profile}",
                "about:blank",
            ],
            preexec_fn=child_fds,
            close_fds=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        reply = self.wait(lambda m, i=self._next_id: m.get("id") == i)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait(self, matches: Any, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                message = json.loads(raw)
                if "id" not in message:
                    self.events.append(message)
                if matches(message):
                    return message
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        raise TimeoutError("no reply from Chromium")

    def close(self) -> None:
        try:
            os.write(self._to_chrome, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.process.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            os.close(self._to_chrome)
            os.close(self._from_chrome)


def _errors(events: list[dict[str, Any]]) -> list[str]:
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            found.append(f"{params['entry'].get('text')} {params['entry'].get('url', '')}")
        elif method == "Runtime.exceptionThrown":
            found.append(str(params["exceptionDetails"].get("text")))
    return found


def open_page(path: str | Path, *, full_page: bool = False) -> PageReport:
    """Load `path` in headless Chromium; see the module docstring."""
    binary = chromium_binary()
    if binary is None:
        raise RuntimeError("no Chromium binary on PATH")
    with tempfile.TemporaryDirectory(prefix="pgdiag-chromium-") as profile:
        pipe = _Pipe(binary, profile)
        try:
            target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                pipe.call(f"{domain}.enable", session=session)
            width, height = VIEWPORT
            pipe.call(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                session=session,
            )
            pipe.call("Page.navigate", {"url": Path(path).resolve().as_uri()}, session=session)
            pipe.wait(lambda m: m.get("method") == "Page.loadEventFired")
            value = pipe.call(
                "Runtime.evaluate", {"expression": PROBE, "returnByValue": True}, session=session
            )["result"]["value"]
            probe = json.loads(value)
            shot = pipe.call(
                "Page.captureScreenshot",
                {"format": "png", "captureBeyondViewport": full_page},
                session=session,
            )["data"]
            return PageReport(_errors(pipe.events), probe, base64.b64decode(shot))
        finally:
            pipe.close()
