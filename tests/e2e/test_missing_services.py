"""A stack missing a service answers 503 at once instead of hanging."""

from __future__ import annotations

import time

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import Stack, StackConfig

BODY = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def wait_http(stack: Stack, deadline_s: float = 60) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert not stack.dead_services(), stack.dead_services()
        try:
            httpx.get(stack.base_url + "/v1/models", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise TimeoutError("gateway did not come up")


@pytest.mark.parametrize("missing", [("tokenizer",), ("scheduler", "worker")], ids=["no-tokenizer", "no-scheduler"])
def test_missing_service_gives_503_fast(missing, tmp_path):
    stack = Stack(StackConfig(port=free_port(), without=frozenset(missing), log_dir=str(tmp_path)))
    stack.start()
    try:
        wait_http(stack)
        start = time.monotonic()
        resp = httpx.post(stack.base_url + "/v1/chat/completions", json=BODY, timeout=30)
        elapsed = time.monotonic() - start
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["message"] and error["type"]
        assert elapsed < 5.0
        health = httpx.get(stack.base_url + "/health", timeout=5)
        if "tokenizer" in missing:
            assert health.status_code == 503
    finally:
        stack.stop()
