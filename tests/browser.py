"""Headless Chromium for page tests, driven over W3C WebDriver by Debian's chromedriver.

A few calls of the WebDriver protocol (new session, navigate, run a script, screenshot)
over httpx, so the tests need no Selenium. Chromium and ChromeDriver come from Debian's
``chromium`` and ``chromium-driver`` packages (``.ci/run`` installs them); it runs with
the flags that work in a sandbox without a network: no sandbox, no GPU, no background
networking, a fresh profile.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from services.launch.nats_server import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL = "apt-get install -y chromium chromium-driver"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--hide-scrollbars"]
START_TIMEOUT = 30.0


def missing() -> str | None:
    """Why no browser test can run here (None: Chromium and its driver are installed)."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            return f"{path} is not installed ({INSTALL})"
    return None


class Chromium:
    def __init__(self, width: int = 1280, height: int = 1000) -> None:
        self.profile = tempfile.mkdtemp(prefix="natsllm-chromium-")
        port = free_port()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        try:
            self._wait_for_driver()
            options = {"binary": CHROMIUM, "args": [*FLAGS, f"--user-data-dir={self.profile}",
                                                    f"--window-size={width},{height}"]}
            answer = self._call("POST", "/session", {"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": options}}})
            self.session = f"/session/{answer['sessionId']}"
        except BaseException:
            self._stop_driver()
            raise

    def _wait_for_driver(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                if self.http.get("/status").json()["value"]["ready"]:
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline or self.driver.poll() is not None:
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.1)

    def _call(self, method: str, path: str, body: dict | None = None):
        response = self.http.request(method, path, json=body)
        value = response.json().get("value")
        if response.status_code != 200:
            raise RuntimeError(f"WebDriver {method} {path}: {value}")
        return value

    def get(self, url: str) -> None:
        self._call("POST", f"{self.session}/url", {"url": url})

    def run(self, script: str, *args):
        """The value of ``script`` (a function body: ``return ...``) run in the page."""
        return self._call("POST", f"{self.session}/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, timeout: float, what: str):
        """Until ``script`` returns something truthy; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.run(script)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} (after {timeout:g}s)")
            time.sleep(0.25)

    def screenshot(self, path: Path) -> None:
        Path(path).write_bytes(base64.b64decode(self._call("GET", f"{self.session}/screenshot")))

    def _stop_driver(self) -> None:
        self.driver.terminate()
        try:
            self.driver.wait(10)
        except subprocess.TimeoutExpired:
            self.driver.kill()
            self.driver.wait()
        self.http.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def close(self) -> None:
        try:
            self._call("DELETE", self.session)
        finally:
            self._stop_driver()

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
