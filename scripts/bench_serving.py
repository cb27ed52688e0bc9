"""Load generator for any OpenAI-compatible server on this machine (ours, llama.cpp's, vLLM's).

In the manner of vLLM's ``benchmarks/benchmark_serving.py``: a seeded synthetic
dataset of real text (prompt and output lengths drawn uniformly around
``--input-len`` / ``--output-len`` with ``--range-ratio`` spread; an optional shared
system prompt of ``--shared-prefix-len`` tokens for prefix caching), sent at a fixed
Poisson ``--request-rate`` (inf = all at once) and/or under a ``--max-concurrency``
cap, always streaming (SSE). Every request asks for exactly its drawn output length
(``max_tokens`` = ``min_tokens`` = length, ``ignore_eos``), so every engine generates
the same number of tokens. Output tokens come from ``usage`` when the server sends it
(``stream_options.include_usage``), else from the number of content chunks.

Reports request throughput, output and total tokens/s, TTFT, TPOT, ITL and end-to-end
latency (mean, median, p99), failures; prints a table and writes JSON (``--result-file``).

    .venv/bin/python scripts/bench_serving.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 64 --max-concurrency 32 --input-len 128 --output-len 64

``--models a,b,c`` spreads the requests over several served names (request ``i`` uses
the ``i``-th modulo their number, e.g. LoRA adapters; each is warmed up once).

Only loopback targets are accepted; the run is bounded by ``--num-prompts`` and
``--timeout`` (seconds for the whole run; unfinished requests count as failures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import SampleRequest, check_loopback_url, fmt, make_dataset, summarize  # noqa: E402

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


def build_payload(endpoint: str, model: str, req: SampleRequest, args) -> dict:
    """The JSON body for one request."""
    body: dict = {"model": model, "stream": True, "max_tokens": req.output_len}
    if args.temperature is not None:  # None: the server's default sampling
        body["temperature"] = args.temperature
    if endpoint == "chat":
        messages = []
        if req.prefix:
            messages.append({"role": "system", "content": req.prefix})
        messages.append({"role": "user", "content": req.prompt})
        body["messages"] = messages
    else:
        body["prompt"] = f"{req.prefix}\n\n{req.prompt}" if req.prefix else req.prompt
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if not args.no_min_tokens:
        body["min_tokens"] = req.output_len
    if not args.no_stream_usage:
        body["stream_options"] = {"include_usage": True}
    if args.extra_body:
        body.update(args.extra_body)
    return body


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


async def send_request(client, url: str, endpoint: str, body: dict, prompt_len: int, timeout: float) -> RequestResult:
    result = RequestResult(prompt_len=prompt_len, output_len_requested=body.get("max_tokens", 0))
    result.start = start = time.perf_counter()
    last = start
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as resp:
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


# --------------------------------------------------------------------------- the run


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


async def run_benchmark(
    args, requests: list[SampleRequest], url: str, prompt_lens: list[int]
) -> tuple[list[RequestResult], float]:
    import httpx

    n = len(requests)
    conns = min(n, args.max_concurrency or n) + 4
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers, trust_env=False) as client:
        if not args.no_warmup:
            for model in dict.fromkeys(args.models or [args.model]):
                await warm_up(client, url, args, requests[0], model)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bodies = [build_payload(args.endpoint, request_model(args, i), r, args) for i, r in enumerate(requests)]
        offsets = arrival_times(n, args.request_rate, args.seed)

        async def one(i: int) -> RequestResult:
            if semaphore is None:
                return await send_request(client, url, args.endpoint, bodies[i], prompt_lens[i], args.request_timeout)
            async with semaphore:
                return await send_request(client, url, args.endpoint, bodies[i], prompt_lens[i], args.request_timeout)

        t0 = time.perf_counter()
        deadline = t0 + args.timeout
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
                results.append(
                    RequestResult(error=f"not finished within --timeout {args.timeout:g}s",
                                  prompt_len=prompt_lens[i], output_len_requested=requests[i].output_len)
                )
        if pending:
            await asyncio.wait(pending, timeout=5)
        ends = [r.start + r.latency for r in results if r.success]
        duration = (max(ends) - t0) if ends else time.perf_counter() - t0
        return results, duration


def request_model(args, i: int) -> str:
    """The model name request ``i`` sends: ``--models`` round-robin, else ``--model``."""
    return args.models[i % len(args.models)] if args.models else args.model


async def warm_up(client, url: str, args, req: SampleRequest, model: str) -> None:
    """One short request, retried until the server answers or --wait-for-server runs out."""
    body = build_payload(args.endpoint, model, SampleRequest(req.prompt, req.prompt_token_ids, min(8, req.output_len)), args)
    deadline = time.monotonic() + max(args.wait_for_server, 0.0)
    while True:
        result = await send_request(client, url, args.endpoint, body, 0, args.request_timeout)
        if result.success:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(f"warm-up request to {url} failed: {result.error}")
        await asyncio.sleep(1.0)


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


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (loopback only)")
    p.add_argument("--model", default="", help="model name sent in requests (default: ask /v1/models)")
    p.add_argument("--models", type=lambda v: v.split(","), default=None,
                   help="comma-separated model names: request i uses the i-th modulo their number")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="completions")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    p.add_argument("--label", default="", help="name of the server in the table and the JSON")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean output length in tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--shared-prefix-len", type=int, default=0, help="a common system prompt of ~N tokens")
    p.add_argument("--text-file", default=None, help="draw prompt text from this file (default: built-in paragraphs)")
    p.add_argument("--tokenizer", default=None, help="GGUF file or HF folder whose tokenizer sizes prompts (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=0, help="at most this many requests in flight (0: no cap)")
    p.add_argument("--temperature", type=lambda v: None if v == "default" else float(v), default=0.0,
                   help='sent with every request; "default": none sent, the server samples as it defaults to')
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--no-min-tokens", action="store_true", help="do not send min_tokens")
    p.add_argument("--no-stream-usage", action="store_true", help="do not ask for usage in the stream")
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON object merged into every request body")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds for one request")
    p.add_argument("--wait-for-server", type=float, default=0.0, help="retry the warm-up request this many seconds")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--result-file", default=None, help="write config, metrics and per-request data as JSON here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    check_loopback_url(args.base_url)
    if args.num_prompts < 1 or args.num_prompts > 100_000:
        p.error("--num-prompts must be in [1, 100000]")
    if args.max_concurrency < 0:
        p.error("--max-concurrency must be >= 0")
    if args.timeout <= 0 or args.request_timeout <= 0:
        p.error("--timeout and --request-timeout must be > 0")
    if args.models is not None and (args.model or not all(args.models)):
        p.error("--models takes non-empty names, and not together with --model")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    return args


def load_encoder(path: str | None):
    from shared.model_config import default_model_path
    from shared.tokenizer import load_tokenizer

    tok = load_tokenizer(path or default_model_path())
    return (lambda s: tok.encode(s, add_special_tokens=False)), (lambda ids: tok.decode(ids)), tok


def served_model(base_url: str, api_key: str) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=10, trust_env=False)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception:
        return "default"


def main(argv: list[str] | None = None) -> int:
    metrics = run(parse_args(argv))
    return 0 if metrics["completed"] > 0 else 1


def run(args: argparse.Namespace) -> dict:
    """One benchmark as ``parse_args`` describes it: prints the table, returns the metrics."""
    encode, decode, _ = load_encoder(args.tokenizer)
    requests = make_dataset(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, encode, decode,
        seed=args.seed, shared_prefix_len=args.shared_prefix_len, text_file=args.text_file,
    )
    # The shared prefix counts toward the prompt length when the server reports none.
    prefix_len = len(encode(requests[0].prefix)) if requests[0].prefix else 0
    prompt_lens = [len(r.prompt_token_ids) + prefix_len for r in requests]
    if not args.model and not args.models:
        args.model = served_model(args.base_url, args.api_key)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    url = args.base_url.rstrip("/") + path
    if not args.quiet:
        print(f"{args.label or args.base_url}: {args.num_prompts} prompts, input ~{args.input_len} "
              f"(+{prefix_len} shared), output {args.output_len}, range {args.range_ratio}, "
              f"rate {args.request_rate}, max concurrency {args.max_concurrency or 'none'}", flush=True)
    results, duration = asyncio.run(run_benchmark(args, requests, url, prompt_lens))
    metrics = compute_metrics(results, duration)
    print(format_table(metrics, args.label))
    if args.result_file:
        config = dict(vars(args))
        config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "label": args.label,
            "config": config,
            "metrics": metrics,
            "requests": [
                {k: v for k, v in asdict(r).items() if k != "start"} | {"tpot": r.tpot} for r in results
            ],
        }
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(nan_to_none(record), indent=1, allow_nan=False))
    return metrics


def nan_to_none(obj):
    """``obj`` with every NaN/inf float replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, dict):
        return {k: nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_to_none(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
