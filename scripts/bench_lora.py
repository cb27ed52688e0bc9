"""Multi-LoRA cost: in-process engine throughput with 0, 1, 4 and 8 distinct adapters.

``--num-prompts`` greedy requests (random token ids, ``--input-len`` prompt tokens,
``--output-len`` output tokens with ignore_eos) run at once through one engine with
``--enable-lora --max-loras 8``; request ``i`` uses adapter ``i % k`` for k distinct
adapters (k = 0: the base model). Adapters are random PEFT folders targeting all seven
projections, at each ``--ranks`` rank. Only generation is timed (output tokens / s).
Ratios are against k = 0 in the same run; so are the tokens per second of the process's
CPU time (``time.process_time``), which a busy machine inflates less than wall time.

    .venv/bin/python scripts/bench_lora.py [--num-prompts 32] [--ranks 8,16]

``--record`` / ``--result-file`` keep the tok/s and the ratios as a result record.

``--served`` measures a served stack instead: per rank, the same adapters are served as
``adapter-0`` .. ``adapter-(K-1)`` (K the largest k, 8) by a stack started like ``scripts/serve --enable-lora
--max-loras K --max-lora-rank R --lora-modules adapter-0=PATH ... --max-num-seqs 32`` on a
free port, and ``scripts/bench_serving.py``'s load generator sends ``--num-prompts``
streamed requests (its synthetic text, ``--input-len`` / ``--output-len`` tokens) at
``--concurrency`` 32, request ``i`` with model ``adapter-(i % k)`` (k = 0: the base model).
Each k draws other prompts (seed k), so no k reuses another's prefix-cache blocks; every
served name is warmed up first. Output tok/s over the whole run, ratios against k = 0.

``--kernels`` times the LoRA delta alone instead (``services/worker/lora/batched.py``):
each CPU method (``--methods``: masked, grouped, bgmv) over the four fused projections of
one layer of the default model, ``--max-loras 8`` slots in ``--dtype``, per rank, tokens
per step (32 = a decode step of 32 requests; 256 and 512 = prefill chunks) and distinct
adapters in the step; the tokens are spread evenly over the adapters (``--shuffle``: in
random order, as a decode step's requests are). Each step's ``LoRABatch`` is built in the
timed part, as the worker builds one per step. The fastest of ``--repeats`` runs (the
methods alternate), microseconds: on a shared machine the minimum is the least disturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from bench import record  # noqa: E402
from bench.client import served_model  # noqa: E402
from bench.engines import engine as make_engine  # noqa: E402
from bench.engines import stack  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, model_config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for the model (all seven targets)."""
    from safetensors.torch import save_file

    from shared.lora_shapes import FUSED_PROJECTIONS, MODULE_TO_PROJECTION, ProjectionShapes

    shapes = ProjectionShapes.of(model_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module in TARGETS:
            projection = MODULE_TO_PROJECTION[module]
            out = shapes.out_features[projection][FUSED_PROJECTIONS[projection].index(module)]
            block = "self_attn" if projection in ("qkv", "o") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, shapes.in_features[projection], generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))
    return folder


def bench_kernels(ranks: list[int], counts: list[int], token_counts: list[int], repeats: int,
                  methods: list[str], dtype: torch.dtype, shuffle: bool) -> dict:
    from services.worker.lora.batched import LoRABatch, add_lora
    from shared.lora_shapes import FUSED_PROJECTIONS, ProjectionShapes
    from shared.model_config import default_model_path, load_model_config

    shapes = ProjectionShapes.of(load_model_config(default_model_path()))
    num_slots = 8
    gen = torch.Generator().manual_seed(0)
    results = {}
    for rank in ranks:
        weights = {p: (torch.randn(num_slots, shapes.stacked_rank(p, rank), shapes.in_features[p],
                                   generator=gen).to(dtype),
                       torch.randn(num_slots, shapes.stacked_rank(p, rank), sum(shapes.out_features[p]),
                                   generator=gen).to(dtype))
                   for p in FUSED_PROJECTIONS}
        for num_tokens in token_counts:
            xs = {p: torch.randn(num_tokens, shapes.in_features[p], generator=gen).to(dtype) for p in FUSED_PROJECTIONS}
            ys = {p: torch.randn(num_tokens, sum(shapes.out_features[p]), generator=gen).to(dtype)
                  for p in FUSED_PROJECTIONS}
            for k in counts:
                token_slot = torch.arange(num_tokens) * k // num_tokens  # k even runs of tokens
                if shuffle:
                    token_slot = token_slot[torch.randperm(num_tokens, generator=gen)]
                times = {method: [] for method in methods}
                for _ in range(repeats):  # the methods alternate, so all meet the same load
                    for method, runs in times.items():
                        t0 = time.perf_counter()
                        batch = LoRABatch.build(token_slot, num_slots, dtype, torch.device("cpu"), method)
                        for p, (a, b) in weights.items():
                            add_lora(ys[p], xs[p], a, b, batch, shapes.out_features[p])
                        runs.append(time.perf_counter() - t0)
                row = {method: min(runs) * 1e6 for method, runs in times.items()}
                results[f"rank={rank} tokens={num_tokens} adapters={k}"] = row
                ratios = [f"{m}/{methods[0]} {row[m] / row[methods[0]]:.2f}" for m in methods[1:]]
                print(f"rank {rank:2d}  tokens {num_tokens:4d}  adapters {k}:  "
                      + "  ".join(f"{m} {us:8.0f} us" for m, us in row.items()) + "  " + "  ".join(ratios), flush=True)
    return results


def bench_served(args, ranks: list[int], counts: list[int], engine_flags: list[str]) -> dict[int, dict[int, float]]:
    """Output tok/s of a served stack per rank and number of distinct adapters (module docstring)."""
    import bench_serving

    from shared.model_config import default_model_path, load_model_config

    model_config = load_model_config(default_model_path())
    results: dict[int, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in ranks:
            modules = [f"adapter-{i}={write_adapter(Path(tmp) / f'r{rank}-{i}', model_config, rank, i)}"
                       for i in range(max(counts))]
            flags = [*engine_flags, "--enable-lora", "--max-loras", str(max(max(counts), 1)), "--max-lora-rank", str(rank),
                     "--max-num-seqs", str(args.concurrency)] + (["--lora-modules", " ".join(modules)] if modules else [])
            print(f"rank {rank}: scripts/serve {shlex.join(flags)}", flush=True)
            with stack(flags) as running:
                base = served_model(running.base_url)
                results[rank] = {}
                for k in counts:
                    names = [f"adapter-{i}" for i in range(k)] or [base]
                    metrics = bench_serving.run(bench_serving.parse_args([
                        "--base-url", running.base_url, "--models", ",".join(names), "--quiet",
                        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--seed", str(k), "--label", f"rank {rank}, {k} adapter(s)"]))
                    if metrics["failed"]:
                        raise SystemExit(f"rank {rank}, {k} adapter(s): {metrics['failed']} requests failed: "
                                         f"{metrics['errors']}")
                    results[rank][k] = metrics["output_throughput"]
                    print(f"rank {rank:3d}  {k} adapter(s): {results[rank][k]:8.1f} output tok/s "
                          f"({results[rank][k] / results[rank][counts[0]]:.2f}x of {counts[0]})", flush=True)
    return results


def ratio_table(results: dict[int, dict[int, float]], counts: list[int]) -> list[dict]:
    """Per rank: the base's tok/s, and each number of adapters' tok/s over it."""
    return [{"rank": rank, f"{counts[0]} adapters tok/s": by_k[counts[0]],
             **{f"{k} adapter{'s' if k != 1 else ''}": v / by_k[counts[0]] for k, v in by_k.items() if k != counts[0]}}
            for rank, by_k in results.items()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other flags go to the engine (in-process) or the stack (--served), as "
                                       "scripts/serve's.")
    p.add_argument("--kernels", action="store_true", help="time the LoRA delta alone, per method")
    p.add_argument("--served", action="store_true", help="measure a served stack (scripts/serve) over HTTP")
    p.add_argument("--concurrency", type=int, default=32, help="--served: requests in flight (and --max-num-seqs)")
    p.add_argument("--tokens", default="32,256,512", help="--kernels: tokens per step")
    p.add_argument("--methods", default="grouped,bgmv,masked", help="--kernels: methods (ratios against the first)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="--kernels: dtype")
    p.add_argument("--shuffle", action="store_true", help="--kernels: tokens in random slot order")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ranks", default="8,16")
    p.add_argument("--adapters", default="0,1,4,8", help="numbers of distinct adapters to run")
    p.add_argument("--method", default=None, help="force a LoRA method of batched.METHODS (default: chosen per step)")
    record.add_arguments(p)
    args, engine_flags = p.parse_known_args(argv)
    config = {**{k: v for k, v in vars(args).items() if k not in ("record", "result_file")},
              "engine_flags": engine_flags}
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kernels:
        counts = [int(k) for k in args.adapters.split(",") if int(k) > 0]
        results = bench_kernels([int(r) for r in args.ranks.split(",")], counts,
                                [int(t) for t in args.tokens.split(",")], args.repeats, args.methods.split(","),
                                getattr(torch, args.dtype), args.shuffle)
        print(json.dumps({"us": results, "threads": torch.get_num_threads(), "dtype": args.dtype}))
        record.save(record.Record("lora_kernels", "lora-kernels", config=config, results={"us": results}), args)
        return

    load_start = os.getloadavg()  # the machine may be shared: the figures say how busy it was
    counts = [int(k) for k in args.adapters.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.served:
        results = bench_served(args, ranks, counts, engine_flags)
        record.save(record.Record("lora", "lora-served", config=config, results={
            "table": ratio_table(results, counts), "tok_s": results, "load_average_at_start": load_start[0]}), args)
        return

    from shared.protocol import LoRARequest, SamplingParams

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results: dict[int, dict[int, float]] = {}
    cpu_results: dict[int, dict[int, float]] = {}  # output tokens per second of process CPU time
    with tempfile.TemporaryDirectory() as tmp:
        for rank in ranks:
            need_blocks = args.num_prompts * ((args.input_len + args.output_len) // 16 + 2)
            slots = str(max(max(counts), 1))
            engine = make_engine([*engine_flags, "--enable-lora", "--max-loras", slots, "--max-lora-rank", str(rank),
                                  "--max-cpu-loras", slots],
                                 num_gpu_blocks=need_blocks, max_num_seqs=args.num_prompts)
            engine.worker.lora.method = args.method
            vocab = engine.model_config.vocab_size
            loras = [LoRARequest(f"r{rank}-{i}", str(write_adapter(Path(tmp) / f"r{rank}-{i}",
                                                                   engine.model_config, rank, i)))
                     for i in range(max(counts))]
            # Warm-up: every adapter read and put in a slot once.
            engine.generate([[1, 2, 3]] * max(len(loras), 1), SamplingParams(max_tokens=2), loras or None)
            results[rank], cpu_results[rank] = {}, {}
            for k in counts:
                prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
                           for _ in range(args.num_prompts)]
                choices = [loras[i % k] if k else None for i in range(args.num_prompts)]
                t0, cpu0 = time.perf_counter(), time.process_time()
                engine.generate(prompts, params, choices)
                seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
                results[rank][k] = args.num_prompts * args.output_len / seconds
                cpu_results[rank][k] = args.num_prompts * args.output_len / cpu_seconds
                print(f"rank {rank:3d}  {k} adapter(s): {results[rank][k]:8.1f} output tok/s "
                      f"({results[rank][k] / results[rank][counts[0]]:.2f}x of {counts[0]}); per CPU second "
                      f"{cpu_results[rank][k]:8.1f} ({cpu_results[rank][k] / cpu_results[rank][counts[0]]:.2f}x)",
                      flush=True)
    ratios = {r: {k: v / by_k[counts[0]] for k, v in by_k.items()} for r, by_k in results.items()}
    cpu_ratios = {r: {k: v / by_k[counts[0]] for k, v in by_k.items()} for r, by_k in cpu_results.items()}
    record.save(record.Record("lora", "lora-in-process", config=config, results={
        "table": ratio_table(results, counts), "tok_s": results, "ratio": ratios, "tok_per_cpu_s": cpu_results,
        "cpu_ratio": cpu_ratios, "threads": torch.get_num_threads(), "method": args.method or "auto",
        "load_average_at_start": load_start[0]}), args)


if __name__ == "__main__":
    main()
