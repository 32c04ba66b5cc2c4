"""Headless Chromium driven over the Chrome DevTools Protocol, standard library only.

Chromium is started with `--remote-debugging-pipe`: it reads commands on fd 3 and writes replies
and events on fd 4, each one JSON message ending in a NUL byte. The network is closed three ways:
every host name resolves to nothing (`--host-resolver-rules`), background services are off, and
the page's own requests are recorded (`Network.requestWillBeSent`) so a test can assert there
were none beyond the file itself.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
NETWORK_OFF = (
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-domain-reliability",
    "--no-pings",
    "--no-proxy-server",
    "--metrics-recording-only",
)


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless Chromium; `open(url)` gives a Page. Use as a context manager."""

    def __init__(self, executable: str, profile: Path, width: int = 1280,
                 height: int = 900) -> None:
        self.width, self.height = width, height
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def pipes() -> None:  # in the child, before exec: the fds Chromium expects
            # Move both ends above 9 first: a pipe end may already be fd 3 or 4 (dup2 onto
            # itself would keep its close-on-exec flag) or sit where the other must go.
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w)]
            os.dup2(high[0], 3)  # inheritable: open in Chromium
            os.dup2(high[1], 4)

        self._log = open(profile / "chromium.log", "wb")  # closed in close()
        args = [executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-dev-shm-usage", "--mute-audio",
                "--hide-scrollbars", f"--user-data-dir={profile}", "--remote-debugging-pipe",
                f"--window-size={width},{height}", *NETWORK_OFF, "about:blank"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, close_fds=False,
                                     preexec_fn=pipes)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._to_browser, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str | None = None,
                   timeout: float = 30.0) -> dict[str, Any]:
        """The first event of this method (already received or next)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if event.get("method") == method and event.get("sessionId") == session:
                    return event
            seen = len(self.events)
            self.events.append(self._read(deadline, method))

    def _read(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"Chromium did not answer {waiting_for}")
            ready, _, _ = select.select([self._from_browser], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise CDPError(f"Chromium closed the pipe (exit {self.proc.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def open(self, url: str) -> Page:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"]
        self.send("Target.activateTarget", {"targetId": target})
        page = Page(self, session, target)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(f"{domain}.enable")
        page.send("Emulation.setDeviceMetricsOverride", {
            "width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        page.navigate(url)
        return page

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("Browser.close", timeout=5)
            except (CDPError, TimeoutError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._log.close()


class Page:
    def __init__(self, browser: Browser, session: str, target: str) -> None:
        self.browser = browser
        self.session = session
        self.target = target

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})

    def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.send(method, params, self.session)

    def navigate(self, url: str) -> None:
        start = len(self.browser.events)
        self.send("Page.navigate", {"url": url})
        deadline = time.monotonic() + 30
        while not any(e.get("method") == "Page.loadEventFired" and
                      e.get("sessionId") == self.session for e in self.browser.events[start:]):
            self.browser.events.append(self.browser._read(deadline, "Page.loadEventFired"))

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise CDPError(f"{expression!r} threw: "
                           f"{details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def center(self, selector: str) -> tuple[float, float]:
        """Viewport coordinates of the middle of the first element matching a CSS selector
        (scrolled into view first)."""
        box = self.evaluate(
            f"(() => {{ const n = document.querySelector({json.dumps(selector)});"
            " n.scrollIntoView({block: 'center'}); const r = n.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        return box[0], box[1]

    def mouse(self, kind: str, x: float, y: float) -> None:
        params: dict[str, Any] = {"type": kind, "x": x, "y": y}
        if kind in ("mousePressed", "mouseReleased"):
            params.update(button="left", clickCount=1)
        self.send("Input.dispatchMouseEvent", params)

    def hover(self, selector: str) -> None:
        self.mouse("mouseMoved", *self.center(selector))

    def click(self, selector: str) -> None:
        x, y = self.center(selector)
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y)
        self.mouse("mouseReleased", x, y)

    def screenshot(self) -> bytes:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        return base64.b64decode(data)

    def _events(self) -> list[dict[str, Any]]:
        return [e for e in self.browser.events if e.get("sessionId") == self.session]

    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error/assert calls and error log entries (failed loads,
        Content-Security-Policy refusals)."""
        found = []
        for event in self._events():
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error",
                                                                                   "assert"):
                found.append(json.dumps(params.get("args", []))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append(params["entry"].get("text", "")[:500])
        return found

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self._events()
                if e.get("method") == "Network.requestWillBeSent"]
