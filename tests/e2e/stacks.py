"""Running a whole stack for a test module, with the services' tracebacks on failure."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import httpx

from services.launch.nats_server import free_port
from services.launch.stack import Stack, StackConfig


def replicated_config(log_dir, args: list[str]) -> StackConfig:
    """A stack with two tokenizer and two detokenizer replicas on a free port."""
    return StackConfig(port=free_port(), num_tokenizers=2, num_detokenizers=2, args=args, log_dir=str(log_dir))


# The tests compare greedy tokens with Hugging Face's fp32 model and with the in-process
# fp32 worker, so a stack's workers run float32 unless its args name a dtype (--dtype
# auto would pick bfloat16 on a CPU with native bf16 dot products), and dequantize the
# weights unless its args name a quantization (--quantization auto keeps int4 weights and
# quantizes activations to int8).
EXACT_DTYPE = ["--dtype", "float32"]
EXACT_WEIGHTS = ["--quantization", "none"]
# Workers of a stack with more than one (P/D engines, TP ranks) share the cores: an OpenMP
# thread spinning between regions holds a core that another worker's thread needs, so they
# run with the passive wait policy (the setting's help), unless the args name one.
SHARED_CORES_WAIT = ["--omp-wait-policy", "passive"]


@contextlib.contextmanager
def running_stack(config: StackConfig, timeout: float = 240, show=None):
    """Start the stack (its workers in float32 with dequantized weights unless
    ``config.args`` name a dtype / a quantization; with the passive OpenMP wait policy when
    there is more than one worker, unless they name one), wait until the engine is ready (``show``:
    called with each line of start-up progress meanwhile), stop it afterwards; any traceback in a
    service's log is printed (pytest shows it for a failed test)."""
    if "--dtype" not in config.args:
        config = dataclasses.replace(config, args=[*EXACT_DTYPE, *config.args])
    if "--quantization" not in config.args:
        config = dataclasses.replace(config, args=[*EXACT_WEIGHTS, *config.args])
    if config.num_workers > 1 and "--omp-wait-policy" not in config.args:
        config = dataclasses.replace(config, args=[*SHARED_CORES_WAIT, *config.args])
    stack = Stack(config)
    stack.start()
    try:
        stack.wait_ready(timeout=timeout, show=show)
        yield stack
    finally:
        stack.stop()
        if config.log_dir:
            for log in sorted(Path(config.log_dir).iterdir()):
                text = log.read_text(errors="replace")
                if "Traceback" in text:
                    print(f"---- {log.name}\n{text[-4000:]}")


def metric(stack, name: str) -> float:
    """One value of the gateway's /metrics (the first series of ``name``)."""
    text = httpx.get(stack.base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


async def stream_or_error(http, path: str, body: dict, started: asyncio.Event | None = None):
    """The streamed text of a completions or chat request (``body`` names the model), or the
    error event that ended it; ``started`` is set at the first text."""
    text = []
    async with http.stream("POST", path, json={"stream": True, **body}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return event["error"]
            choice = event["choices"][0]
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if started is not None and text[-1]:
                started.set()
    return "".join(text)
