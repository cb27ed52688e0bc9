"""vLLM's own load generator, `vllm bench serve`, run against our server: the client vLLM
users measure with. It runs from ``build/vllm-venv`` (``scripts/bench_peers.sh`` installs
vLLM's CPU build there) with the Hugging Face folder ``build/hf-model`` as its tokenizer,
offline; the result is the JSON ``--save-result`` writes (its keys: ``completed``,
``failed``, ``errors``, ``output_throughput``, ``median_ttft_ms``, ``p90_ttft_ms``, ...).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from . import ROOT

VLLM_VENV = ROOT / "build" / "vllm-venv"
HF_TOKENIZER = ROOT / "build" / "hf-model"
BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def available() -> str | None:
    """Why vLLM's client cannot run here, or None when it can."""
    if not (VLLM_VENV / "bin" / "python").exists():
        return f"no {VLLM_VENV} (scripts/bench_peers.sh makes it)"
    if not (HF_TOKENIZER / "tokenizer.json").exists():
        return f"no {HF_TOKENIZER} (scripts/bench_peers.sh writes it from the GGUF)"
    return None


def bench_serve(base_url: str, model: str, load_args: list[str], result_file: Path, timeout: float) -> dict:
    """One run of `vllm bench serve` (``load_args``: the dataset, the rate, sampling, ...) on
    ``/v1/completions``; its result (its output goes to ``result_file`` with ``.log``).
    Raises when it fails or any request failed."""
    why = available()
    if why:
        raise SystemExit(f"vLLM's client cannot run: {why}")
    result_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(VLLM_VENV / "bin" / "python"), "-c", BENCH_SERVE, "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", model, "--served-model-name", model,
           "--tokenizer", str(HF_TOKENIZER), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles",
           "50,90", "--disable-tqdm", "--save-result", "--result-dir", str(result_file.parent),
           "--result-filename", result_file.name, *load_args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = result_file.with_suffix(".log")
    with open(log, "wb") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if done.returncode:
        tail = log.read_text(errors="replace").splitlines()[-20:]
        raise SystemExit(f"vLLM's client exited with {done.returncode}; its log ({log}) ends:\n" + "\n".join(tail))
    result = json.loads(result_file.read_text())
    if result.get("failed"):
        raise SystemExit(f"{result['failed']} of vLLM's client's requests failed: {result.get('errors', [])[:2]}")
    return result
