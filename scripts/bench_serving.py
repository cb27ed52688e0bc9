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
latency (mean, median, p99), failures; prints a table; ``--result-file`` / ``--record``
write the result record (``bench/record.py``) with every request's figures.

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
from dataclasses import asdict

from bench import record
from bench.client import check_loopback_url, compute_metrics, format_table, new_traceparent, run_load, served_model
from bench.corpus import SampleRequest, default_encoder, make_dataset


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


def request_model(args, i: int) -> str:
    """The model name request ``i`` sends: ``--models`` round-robin, else ``--model``."""
    return args.models[i % len(args.models)] if args.models else args.model


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
    p.add_argument("--traceparent", choices=("none", "sampled", "unsampled"), default="none",
                   help="send each request a W3C traceparent of a new trace, sampled or not (a tracing server "
                        "with a parent-based sampler traces only the sampled ones)")
    p.add_argument("--question", default="serving", help="the summary table the record feeds (with --record)")
    p.add_argument("--quiet", action="store_true")
    record.add_arguments(p)
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


def main(argv: list[str] | None = None) -> int:
    metrics = run(parse_args(argv))
    return 0 if metrics["completed"] > 0 else 1


def run(args: argparse.Namespace) -> dict:
    """One benchmark as ``parse_args`` describes it: prints the table, returns the metrics."""
    encode, decode, _ = default_encoder(args.tokenizer)
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
    bodies = [build_payload(args.endpoint, request_model(args, i), r, args) for i, r in enumerate(requests)]
    warmup = [] if args.no_warmup else [
        build_payload(args.endpoint, model, SampleRequest(requests[0].prompt, requests[0].prompt_token_ids,
                                                          min(8, requests[0].output_len)), args)
        for model in dict.fromkeys(args.models or [args.model])]
    results, duration = asyncio.run(run_load(
        url, args.endpoint, bodies, prompt_lens, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, seed=args.seed, timeout=args.timeout, request_timeout=args.request_timeout,
        api_key=args.api_key, warmup=warmup, wait_for_server=args.wait_for_server,
        request_headers=None if args.traceparent == "none" else
        lambda i: {"traceparent": new_traceparent(args.traceparent == "sampled")}))
    metrics = compute_metrics(results, duration)
    print(format_table(metrics, args.label))
    config = dict(vars(args))
    config["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    config.pop("api_key", None)
    record.save(record.Record(
        "serving", args.question, config=config,
        results={"label": args.label, "metrics": metrics,
                 "requests": [{k: v for k, v in asdict(r).items() if k != "start"} | {"tpot": r.tpot}
                              for r in results]}), args)
    return metrics


if __name__ == "__main__":
    import sys

    sys.exit(main())
