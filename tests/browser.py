"""Headless Chromium driven over the DevTools protocol, for page tests: no extra packages (the
websocket client comes with uvicorn[standard]); Debian's `chromium` is the browser.

    with chromium_page(url) as page:
        page.wait_for("window.ballastDashboard.polls >= 2")
        page.evaluate("document.title")
        png = page.screenshot()
        assert not page.console_errors()

`CHROMIUM` is None where no browser is installed: tests skip on it, saying so.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As root in a container: no sandbox; and no background connections (the network is closed here).
_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
]


class Page:
    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._next = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        mid = self._next
        self._ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self._ws.recv(timeout=30))
            if "id" not in msg:
                self.events.append(msg)
            elif msg["id"] == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.evaluate(f"!!({expression})"):
                return
            time.sleep(0.1)
        raise AssertionError(f"page never satisfied {expression!r} within {timeout_s} s")

    def screenshot(self, selector: str | None = None) -> bytes:
        """A PNG of the viewport, or of the element `selector` finds (small enough to decode)."""
        params: dict[str, Any] = {"format": "png"}
        if selector is not None:
            box = self.evaluate(
                f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                " return {x: r.x, y: r.y, width: r.width, height: r.height}; })()"
            )
            params["clip"] = {**box, "scale": 1}
        return base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads seen so far."""
        self.call("Runtime.evaluate", expression="0")  # drain what arrived since the last call
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                out.append(json.dumps(p["exceptionDetails"])[:500])
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(json.dumps(p.get("args"))[:500])
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(p["entry"].get("text", "")[:500])
        return out


@contextmanager
def chromium_page(url: str) -> Iterator[Page]:
    assert CHROMIUM is not None
    # Chromium's helper processes may still write into the profile for a moment after the
    # browser exits: they are stopped with it (their own process group), and a file one of them
    # left behind in the throwaway profile is not a test failure.
    with tempfile.TemporaryDirectory(prefix="ballast-chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            port = _devtools_port(Path(profile), proc)
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            target = next(t for t in targets if t["type"] == "page")
            with connect(target["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=10) as ws:
                page = Page(ws)
                for domain in ("Page", "Runtime", "Log"):
                    page.call(f"{domain}.enable")
                page.call("Page.navigate", url=url)
                yield page
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the browser and its helpers, then SIGKILL to whatever of them is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """Chromium writes the port it chose for --remote-debugging-port=0 into the profile."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} before opening DevTools")
        if marker.exists() and (text := marker.read_text().split()):
            return int(text[0])
        time.sleep(0.05)
    raise RuntimeError("chromium opened no DevTools port")


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit, non-interlaced PNG such as Chromium's."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    height = channels = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and colour in (2, 6), (depth, colour, interlace)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r) for r in rows]


def pixel(image: tuple[int, int, list[bytes]], x: int, y: int) -> tuple[int, int, int]:
    width, _, rows = image
    channels = len(rows[0]) // width
    row = rows[y]
    return row[x * channels], row[x * channels + 1], row[x * channels + 2]
