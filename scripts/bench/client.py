"""The benchmarks' one streaming client for OpenAI-compatible servers (ours or a peer's).

``send_request`` streams one request (SSE) and times it: TTFT, the gap before each
further text chunk (ITL), the end; output tokens from ``usage`` when the server sends it,
else the number of text chunks. ``run_load`` sends many, at a Poisson rate and/or under a
concurrency cap, after a warm-up; ``compute_metrics`` sums a run up (request and token
throughput, TTFT, TPOT, ITL, end-to-end latency) and ``format_table`` prints it. Only
loopback servers are ever loaded (``check_loopback_url``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from .stats import fmt, summarize

# --------------------------------------------------------------------------- one request


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # from usage if reported, else the dataset's count
    output_len_requested: int = 0
    output_tokens: int = 0  # from usage if reported, else content chunks
    usage_reported: bool = False
    num_chunks: int = 0  # SSE chunks that carried text
    ttft: float = 0.0  # seconds from send to the first text chunk
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    start: float = 0.0  # perf_counter at send
    text_chars: int = 0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return None


def chunk_text(endpoint: str, chunk: dict) -> str:
    """The text a parsed SSE chunk carries ("" for role-only, usage-only, finish chunks)."""
    out = []
    for choice in chunk.get("choices") or ():
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            out.append(delta.get("content") or "")
            out.append(delta.get("reasoning_content") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)


def parse_sse_line(line: str) -> dict | str | None:
    """A ``data:`` line's JSON object, the string "[DONE]", or None for other lines."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    if not data:
        return None
    return json.loads(data)


async def send_request(client, url: str, endpoint: str, body: dict, prompt_len: int, timeout: float,
                       first_text: asyncio.Event | None = None, headers: dict | None = None) -> RequestResult:
    """Stream one request and time it (``first_text``, if given, is set at its first text;
    ``headers``: HTTP headers of this request's own)."""
    result = RequestResult(prompt_len=prompt_len, output_len_requested=body.get("max_tokens", 0))
    result.start = start = time.perf_counter()
    last = start
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    result.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return result
                async for line in resp.aiter_lines():
                    data = parse_sse_line(line)
                    if data is None:
                        continue
                    if data == "[DONE]":
                        break
                    if "error" in data and not data.get("choices"):
                        result.error = f"stream error: {json.dumps(data['error'])[:300]}"
                        return result
                    now = time.perf_counter()
                    text = chunk_text(endpoint, data)
                    if text:
                        if result.num_chunks == 0:
                            result.ttft = now - start
                            if first_text is not None:
                                first_text.set()
                        else:
                            result.itl.append(now - last)
                        last = now
                        result.num_chunks += 1
                        result.text_chars += len(text)
                    usage = data.get("usage")
                    if usage:
                        result.usage_reported = True
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
                        if usage.get("prompt_tokens"):
                            result.prompt_len = int(usage["prompt_tokens"])
        result.latency = time.perf_counter() - start
        if not result.usage_reported:
            result.output_tokens = result.num_chunks
        if result.num_chunks == 0:
            result.error = "no text in the stream"
            return result
        result.success = True
    except TimeoutError:
        result.error = f"request timed out after {timeout:g}s"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(e).__name__}: {e}"[:300]
    return result


def new_traceparent(sampled: bool) -> str:
    """A W3C ``traceparent`` of a new trace whose client span is sampled (flag 01) or not
    (00: a parent-based sampler at the server records nothing of the request)."""
    return f"00-{random.getrandbits(128):032x}-{random.getrandbits(64) or 1:016x}-{'01' if sampled else '00'}"


# --------------------------------------------------------------------------- a run


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: a Poisson process at ``request_rate`` (inf: all at 0)."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


async def run_load(url: str, endpoint: str, bodies: list[dict], prompt_lens: list[int], *,
                   max_concurrency: int = 0, request_rate: float = math.inf, seed: int = 0,
                   timeout: float = 600.0, request_timeout: float = 300.0, api_key: str = "",
                   warmup: list[dict] = (), wait_for_server: float = 0.0,
                   request_headers=None) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` to ``url`` (at most ``max_concurrency`` at once, 0: no cap; arrivals a
    Poisson process at ``request_rate``; ``request_headers(i)``, if given: request ``i``'s
    own HTTP headers), after the ``warmup`` requests; the whole run is
    bounded by ``timeout`` (requests not finished count as failures). Returns every
    request's result and the run's duration (to the last successful end)."""
    import httpx

    n = len(bodies)
    conns = min(n, max_concurrency or n) + 4
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout, connect=10.0),
                                 headers=headers, trust_env=False) as client:
        for body in warmup:
            await warm_up(client, url, endpoint, body, request_timeout, wait_for_server)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        offsets = arrival_times(n, request_rate, seed)

        async def one(i: int) -> RequestResult:
            headers = request_headers(i) if request_headers is not None else None
            if semaphore is None:
                return await send_request(client, url, endpoint, bodies[i], prompt_lens[i], request_timeout,
                                          headers=headers)
            async with semaphore:
                return await send_request(client, url, endpoint, bodies[i], prompt_lens[i], request_timeout,
                                          headers=headers)

        t0 = time.perf_counter()
        deadline = t0 + timeout
        tasks: list[asyncio.Task] = []
        for i in range(n):
            delay = t0 + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(min(delay, max(0.0, deadline - time.perf_counter())))
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(one(i)))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter())) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        results = []
        for i in range(n):
            if i < len(tasks) and tasks[i] in done:
                results.append(tasks[i].result())
            else:
                results.append(RequestResult(error=f"not finished within the run's {timeout:g}s",
                                             prompt_len=prompt_lens[i],
                                             output_len_requested=bodies[i].get("max_tokens", 0)))
        if pending:
            await asyncio.wait(pending, timeout=5)
        ends = [r.start + r.latency for r in results if r.success]
        duration = (max(ends) - t0) if ends else time.perf_counter() - t0
        return results, duration


async def warm_up(client, url: str, endpoint: str, body: dict, request_timeout: float,
                  wait_for_server: float = 0.0) -> None:
    """One request, retried until the server answers or ``wait_for_server`` seconds pass."""
    deadline = time.monotonic() + max(wait_for_server, 0.0)
    while True:
        result = await send_request(client, url, endpoint, body, 0, request_timeout)
        if result.success:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(f"warm-up request to {url} failed: {result.error}")
        await asyncio.sleep(1.0)


async def stream(base_url: str, path: str, body: dict, timeout: float = 300.0, api_key: str = "") -> RequestResult:
    """One streamed request on a client of its own (``path``: /v1/chat/completions or
    /v1/completions)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = "chat" if path.endswith("chat/completions") else "completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers,
                                 trust_env=False) as client:
        return await send_request(client, base_url.rstrip("/") + path, endpoint, body, 0, timeout)


def compute_metrics(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    ms = lambda xs: summarize([x * 1000 for x in xs])  # noqa: E731
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itl]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": total_out / duration if duration > 0 else math.nan,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else math.nan,
        "output_tokens_from_usage": sum(r.usage_reported for r in ok),
        # Requests that generated another number of tokens than they asked for.
        "output_len_mismatch": sum(r.output_tokens != r.output_len_requested for r in ok),
        "mean_chunks_per_request": (sum(r.num_chunks for r in ok) / len(ok)) if ok else math.nan,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms(tpots),
        "itl_ms": ms(itls),
        "e2el_ms": ms([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.success})[:10],
    }


def format_table(m: dict, label: str = "") -> str:
    rows = [
        ("Successful requests", f"{m['completed']}"),
        ("Failed requests", f"{m['failed']}"),
        ("Benchmark duration (s)", fmt(m["duration_s"])),
        ("Total input tokens", f"{m['total_input_tokens']}"),
        ("Total generated tokens", f"{m['total_output_tokens']}"),
        ("Output lengths != requested", f"{m['output_len_mismatch']}"),
        ("Request throughput (req/s)", fmt(m["request_throughput"])),
        ("Output token throughput (tok/s)", fmt(m["output_throughput"])),
        ("Total token throughput (tok/s)", fmt(m["total_token_throughput"])),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        for stat, stat_name in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            rows.append((f"{stat_name} {name} (ms)", fmt(m[key][stat])))
    width = max(len(r[0]) for r in rows) + 2
    title = f" Serving Benchmark Result {label} ".center(width + 12, "=")
    lines = [title] + [f"{k:<{width}}{v:>12}" for k, v in rows] + ["=" * len(title)]
    if m["errors"]:
        lines.append("errors: " + "; ".join(m["errors"]))
    return "\n".join(lines)


def check_loopback_url(url: str) -> str:
    """``url`` unchanged if its host is a loopback address (127.0.0.0/8, ::1, localhost);
    else ValueError: the benchmarks only ever load servers on this machine."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"base URL must be http(s)://..., got {url!r}")
    host = parsed.hostname or ""
    if host == "localhost":
        return url
    try:
        if ipaddress.ip_address(host).is_loopback:
            return url
    except ValueError:
        pass
    raise ValueError(f"only loopback targets are allowed (127.0.0.0/8, [::1], localhost), got host {host!r}")


def served_model(base_url: str, api_key: str = "") -> str:
    """The first model name the server lists ("default" if it lists none)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10, trust_env=False)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception:
        return "default"


def prefix_cache_counts(base_url: str) -> dict[str, float]:
    """The engines' prefix-cache queried and hit tokens so far, summed over engines (the
    gateway's /metrics: ``natsllm:prefix_cache_queries_total`` and ``_hits_total``)."""
    import httpx

    counts = {"queries": 0.0, "hits": 0.0}
    text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        for kind in counts:
            if line.startswith(f"natsllm:prefix_cache_{kind}_total"):
                counts[kind] += float(line.rsplit(" ", 1)[1])
    return counts
