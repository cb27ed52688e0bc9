"""Time of the sampler on one step's logits, per setting, batch size and vocabulary size.

What `Sampler.__call__` costs on float32 logits of [batch, vocab] (the LM head's output),
for the settings users send: greedy, the server default (temperature 1), a chat setting
(temperature 0.7, top_p 0.9), llama.cpp's default chain (temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05), penalties (repetition 1.1, frequency 0.5, presence 0.5 over a
128-token prompt and 64 outputs) and every row seeded. Logits are Zipf-like, as a small
model's (`make_logits`; --flat: Gaussian, a hard case for top-p). Wall time, median of --repeats calls,
the torch threads the worker would use (all cores). Run it with another checkout on
PYTHONPATH to time another version of the sampler (the "before" of a change).

    .venv/bin/python scripts/bench_sampler.py [--batch 1 8 32 128] [--vocab 49152 262144]
        [--settings greedy default chat llama_cpp penalties seeded] [--repeats 15] [--flat]
        [--threads N] [--cpu-time] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.record import describe_cpu  # noqa: E402

# name -> SamplingParams fields
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "default": dict(temperature=1.0),
    "chat": dict(temperature=0.7, top_p=0.9),
    "llama_cpp": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "penalties": dict(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5),
    "seeded": dict(temperature=1.0, seed=1234),
}
PROMPT_LEN, OUTPUT_LEN = 128, 64


def metadata_for(setting: str, batch: int, vocab: int):
    """The sampler's metadata of ``batch`` rows of one setting, built as the worker does."""
    from services.worker.input_batch import CachedRequestState, InputBatch
    from shared.protocol import SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_LEN * 2, **SETTINGS[setting])
    rng = np.random.default_rng(0)
    input_batch = InputBatch(max_num_reqs=batch, max_model_len=PROMPT_LEN + OUTPUT_LEN + 1, max_blocks_per_req=1)
    for i in range(batch):
        tokens = rng.integers(0, vocab, PROMPT_LEN + OUTPUT_LEN).tolist()
        generator = torch.Generator().manual_seed(params.seed + i) if params.seed is not None else None
        input_batch.add_request(CachedRequestState(f"r{i}", tokens, PROMPT_LEN, params, [], 0, None,
                                                   generator=generator, output_token_ids=tokens[PROMPT_LEN:]))
    return input_batch, np.arange(batch)


def make_logits(batch: int, vocab: int, flat: bool = False) -> torch.Tensor:
    """Zipf-like rows: the token of rank r has logit -1.5 ln r (plus noise of std 0.3), ranks
    shuffled, which is close to SmolLM2's own (at temperature 1 a median of 33 tokens
    make up 90% of the mass, 240 are within 2^-12 of the likeliest); ``flat``: Gaussian
    logits of std 2.5, a hard case for top-p (thousands of tokens in its 90%)."""
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    if flat:
        return torch.randn(batch, vocab, generator=gen) * 2.5
    ranks = torch.argsort(torch.rand(batch, vocab, generator=gen), dim=1) + 1
    return -1.5 * torch.log(ranks.float()) + 0.3 * torch.randn(batch, vocab, generator=gen)


def time_setting(setting: str, batch: int, vocab: int, repeats: int, flat: bool = False, cpu: bool = False) -> float:
    """Median milliseconds of building the metadata and sampling one step (wall, or with
    ``cpu`` this process's CPU time)."""
    from services.worker.sampler import Sampler

    logits = make_logits(batch, vocab, flat)
    sampler = Sampler(torch.Generator().manual_seed(0))
    input_batch, rows = metadata_for(setting, batch, vocab)
    clock = time.process_time if cpu else time.perf_counter
    times = []
    for i in range(repeats + 2):
        start = clock()
        sampler(logits, input_batch.make_sampling_metadata(rows))
        if i >= 2:
            times.append(clock() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--vocab", type=int, nargs="+", default=[49152, 262144])
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--flat", action="store_true", help="Gaussian logits (std 2.5), not Zipf-like")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores, as the worker)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this process's CPU time, not the wall clock (steadier on a busy machine; "
                        "with more than one thread it adds the threads' times)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = "CPU" if args.cpu_time else "wall"
    print(f"# {describe_cpu()}; torch threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}")
    print(f"# {clock} milliseconds per step (median): metadata + sampler; "
          f"{'Gaussian' if args.flat else 'Zipf-like'} logits")
    print(f"{'vocab':>7} {'batch':>5} " + " ".join(f"{s:>10}" for s in args.settings))
    results = []
    for vocab in args.vocab:
        for batch in args.batch:
            row = {s: time_setting(s, batch, vocab, args.repeats, args.flat, args.cpu_time) for s in args.settings}
            results.append(dict(vocab=vocab, batch=batch, ms=row))
            print(f"{vocab:>7} {batch:>5} " + " ".join(f"{row[s]:>10.3f}" for s in args.settings), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(cpu=describe_cpu(), clock=clock, threads=torch.get_num_threads(),
                                                   results=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
