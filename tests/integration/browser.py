"""Headless Chromium for the integration tests that look at a page as a person does: a browser
started on a free loopback port and one tab driven over the DevTools protocol (a websocket;
``websockets`` comes with Prefect). Needs a Chromium binary (Debian: ``apt-get install -y chromium``);
:data:`CHROMIUM` is None without one, and the tests using it skip saying so."""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from servers import free_port, stop

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-headless-shell", "chromium-browser",
                                                "google-chrome")) if p), None)
NO_CHROMIUM = "no Chromium binary (Debian: apt-get install -y chromium)"


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, ws_url: str):
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=64 * 2 ** 20, open_timeout=10)
        self.ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict:
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr: str) -> Any:
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expr: str, timeout_s: float = 90) -> Any:
        """Evaluate ``expr`` every second until it is truthy; its last value (falsy on timeout)."""
        deadline = time.time() + timeout_s
        value = None
        while time.time() < deadline:
            value = self.eval(expr)
            if value:
                break
            time.sleep(1)
        return value

    def screenshot(self, path: str | Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        Path(path).write_bytes(base64.b64decode(data))


def _json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@contextmanager
def chromium_page(workdir: Path, width: int = 1400, height: int = 6000) -> Iterator[Page]:
    """A headless Chromium (its own profile under ``workdir``) and one tab; stopped after. The window
    is ``height`` tall from the start: pages that scroll inside a column are then drawn whole."""
    assert CHROMIUM, NO_CHROMIUM
    port = free_port()
    log = open(workdir / "chromium.log", "wb")
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1",
         f"--user-data-dir={workdir / 'chromium-profile'}", f"--window-size={width},{height}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    page = None
    try:
        deadline = time.time() + 60
        while True:
            try:
                ws = next(t["webSocketDebuggerUrl"] for t in _json(f"http://127.0.0.1:{port}/json/list")
                          if t.get("type") == "page")
                break
            except (OSError, StopIteration, ValueError):
                if time.time() > deadline or browser.poll() is not None:
                    raise RuntimeError("chromium did not start: " + (workdir / "chromium.log").read_text()[-2000:])
                time.sleep(0.5)
        page = Page(ws)
        page.call("Page.enable")
        yield page
    finally:
        if page is not None:
            page.ws.close()
        stop(browser, timeout_s=10)
        log.close()
