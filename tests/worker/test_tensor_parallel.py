"""Tensor parallelism at the worker level: ranks as real processes joined by gloo.

- Sharding: each rank's parameters, rebuilt across ranks, are the checkpoint's
  tensors (KV heads split, or replicated when there are fewer than ranks; the
  vocabulary padded to a multiple of the rank count).
- Equivalence: TP=2 (KV heads split) and TP=4 (KV heads replicated) ranks, each fed the
  same step diffs by its own copy of the deterministic in-process scheduler (as every
  rank receives each step diff over the bus), produce the same greedy tokens as TP=1,
  under chunked prefill and preemption; every rank samples the same tokens, random
  sampling (seeded and unseeded) and structured output included; each rank holds 1/tp of the sharded
  weights and its share of the KV cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import re
import traceback
from pathlib import Path

import pytest
import torch

from kernels import get_kernel_ops
from services.launch.nats_server import free_port
from services.worker.models.llama import LlamaForCausalLM
from services.worker.parallel import ShardLayout, TensorParallel, destroy_distributed
from shared.config import CacheConfig, ConfigError, ModelRunConfig, ParallelConfig, SchedulerConfig
from shared.model_config import load_model_config
from shared.model_files import open_weights
from shared.tokenizer import load_tokenizer
from shared.protocol import SCHEDULER_OUTPUT, FinishReason, SamplingParams, StructuredOutputsParams
from tests.greedy_compare import assert_greedy_matches
from tests.hf_reference import hf_greedy, load_hf_model_from_folder, make_tiny_random_llama

VOCAB = 321  # not a multiple of 2 or 4: the last rank's vocabulary slice is padded
NUM_TOKENS = 16
PROMPT_LENGTHS = [3, 17, 40, 70, 150]
NUM_BLOCKS = 16  # too few for all prompts at once: preemption happens
CACHE = CacheConfig(num_gpu_blocks=NUM_BLOCKS)
SCHED = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8)  # chunked prefill
RANK_TIMEOUT = 240


def tiny_model(folder: Path, num_heads: int, num_kv_heads: int, tie: bool = False) -> Path:
    return make_tiny_random_llama(
        folder, seed=3, num_heads=num_heads, num_kv_heads=num_kv_heads, vocab_size=VOCAB,
        hidden_size=96, intermediate_size=96, tie_word_embeddings=tie,
    )


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
SAMPLED = [
    SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=NUM_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True),  # the shared generator
    SamplingParams(temperature=0.8, repetition_penalty=1.3, max_tokens=NUM_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.0, logprobs=3, max_tokens=NUM_TOKENS, ignore_eos=True),
]
# Structured output: every rank keeps its own matchers and masks its own logits.
WORDS = "[a-z]+( [a-z]+)*"
CONSTRAINED = [
    SamplingParams(temperature=1.0, seed=i, max_tokens=NUM_TOKENS, structured_outputs=StructuredOutputsParams(regex=WORDS))
    for i in range(len(PROMPT_LENGTHS))
]


# --------------------------------------------------------------------------- one rank's work


def run_workload(runner) -> dict:
    """Greedy then sampled requests through a local scheduler; tokens per request, a
    digest of every step diff the runner executed, and the rank's sizes."""
    from services.engine import Engine

    digest = hashlib.sha256()
    execute = runner.execute_model

    def recording(out, *clock):
        digest.update(SCHEDULER_OUTPUT.encode(out))
        return execute(out, *clock)

    runner.execute_model = recording
    result: dict = {"tokens": {}, "logprobs": {}}
    batches = [("greedy", [GREEDY] * len(PROMPT_LENGTHS)), ("sampled", SAMPLED), ("constrained", CONSTRAINED)]
    preemptions = 0
    for name, params in batches:
        engine = Engine(cache_config=CACHE, scheduler_config=SCHED, worker=runner)
        ids = [
            engine.add_request(p, sp, request_id=f"{name}-{i}")
            for i, (p, sp) in enumerate(zip(prompts(), params))
        ]
        pending = set(ids)
        while pending:
            for out in engine.step():
                result["tokens"].setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.logprobs:
                    result["logprobs"].setdefault(out.request_id, []).extend(lp.token_ids for lp in out.logprobs)
                if out.finish_reason != FinishReason.NONE:
                    pending.discard(out.request_id)
        engine.flush()
        preemptions += engine.scheduler.num_preemptions
    runner.execute_model = execute
    model = runner.model
    result.update(
        digest=digest.hexdigest(),
        preemptions=preemptions,
        kv_shape=list(runner.kv_caches[0][0].shape),
        kv_block_bytes=runner.kv_block_bytes(),
        param_shapes={n: list(p.shape) for n, p in model.named_parameters()},
        num_params=sum(p.numel() for p in model.parameters()),
    )
    return result


def make_runner(model_dir: str, parallel_config: ParallelConfig = ParallelConfig()):
    from services.worker.model_runner import ModelRunner

    # Unpacked weights, so that the test can read each rank's parameter shapes; the
    # services' TP tests run the prepacked default.
    return ModelRunner(
        ModelRunConfig(model=model_dir, kernel_backend="torch", device="cpu", dtype="float32", quantization="none", seed=7, cpu_prepack=False),
        CACHE, SCHED, parallel_config,
    )


def write_rank_result(out_dir: str, rank: int, compute) -> None:
    """A rank process's body: ``compute()``'s result, or its traceback, to rank{rank}.json."""
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.json"
    try:
        out.write_text(json.dumps(compute()))
    except BaseException:
        out.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        destroy_distributed()


def _rank_main(rank: int, world_size: int, init_method: str, model_dir: str, out_dir: str) -> None:
    write_rank_result(out_dir, rank,
                      lambda: run_workload(make_runner(model_dir, ParallelConfig(world_size, rank, init_method))))


def run_ranks(model_dir: Path, world_size: int, out_dir: Path, rank_main=None, *extra_args) -> list[dict]:
    """Run ``rank_main(rank, world_size, init_method, model_dir, out_dir, *extra_args)``
    (default ``_rank_main``) in one process per rank; each rank's rank{r}.json."""
    ctx = multiprocessing.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=rank_main or _rank_main,
                    args=(r, world_size, init_method, str(model_dir), str(out_dir), *extra_args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(RANK_TIMEOUT)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    results = []
    for r in range(world_size):
        path = out_dir / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing (exit code {procs[r].exitcode})"
        result = json.loads(path.read_text())
        assert "error" not in result, f"rank {r} failed:\n{result['error']}"
        results.append(result)
    return results


# --------------------------------------------------------------------------- sharding


def test_shard_layout_rejects_heads_that_do_not_divide(tmp_path):
    cfg = load_model_config(tiny_model(tmp_path / "m", 4, 2))
    with pytest.raises(ConfigError, match="attention heads"):
        ShardLayout.for_rank(cfg, 0, 3)
    layout = ShardLayout.for_rank(cfg, 1, 4)  # 2 KV heads, 4 ranks: replicated
    assert (layout.num_heads, layout.num_kv_heads, layout.kv_head_start, layout.kv_replicated) == (1, 1, 0, True)
    layout = ShardLayout.for_rank(cfg, 3, 4)
    assert (layout.head_start, layout.kv_head_start) == (3, 1)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,tp,tie",
    [(4, 2, 2, False), (8, 2, 4, True), (6, 3, 3, False), (4, 1, 2, False)],
)
def test_rank_shards_reassemble_the_checkpoint(tmp_path, num_heads, num_kv_heads, tp, tie):
    folder = tiny_model(tmp_path / "m", num_heads, num_kv_heads, tie)
    cfg = load_model_config(folder)
    hd, nh, nkv = cfg.head_dim, num_heads, num_kv_heads
    with open_weights(folder) as src:
        full = {n: src.load(n) for n in src.names()}
    shards = []
    for rank in range(tp):
        model = LlamaForCausalLM(cfg, ops=get_kernel_ops("torch"), tp=TensorParallel(rank, tp))
        with open_weights(folder) as src:
            model.load_weights_from(src)
        shards.append(model)
    kv_per_rank = nkv // tp if nkv >= tp else 1
    vocab_rows = math.ceil(VOCAB / tp)
    single = LlamaForCausalLM(cfg, ops=get_kernel_ops("torch"))
    for m in shards:
        attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
        assert attn.qkv_proj.weight.shape == ((nh // tp + 2 * kv_per_rank) * hd, cfg.hidden_size)
        assert attn.o_proj.weight.shape == (cfg.hidden_size, nh // tp * hd)
        assert mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size // tp, cfg.hidden_size)
        assert mlp.down_proj.weight.shape == (cfg.hidden_size, cfg.intermediate_size // tp)
        assert m.embed_tokens.weight.shape == (vocab_rows, cfg.hidden_size)
        assert (m.lm_head.weight is None) == tie
        sharded = sum(p.numel() for n, p in m.named_parameters() if "norm" not in n)
        full_sharded = sum(p.numel() for n, p in single.named_parameters() if "norm" not in n)
        kv_extra = 0 if nkv >= tp else cfg.num_hidden_layers * 2 * hd * cfg.hidden_size * (tp - nkv) / tp
        pad = (vocab_rows * tp - VOCAB) * cfg.hidden_size * (1 if tie else 2) / tp
        assert sharded == pytest.approx(full_sharded / tp + kv_extra + pad)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = [m.layers[i].self_attn.qkv_proj.weight for m in shards]
        q_rows = nh // tp * hd
        kv_rows = kv_per_rank * hd
        torch.testing.assert_close(torch.cat([w[:q_rows] for w in qkv]), full[p + "self_attn.q_proj.weight"], rtol=0, atol=0)
        for j, name in ((0, "k_proj"), (1, "v_proj")):
            parts = [w[q_rows + j * kv_rows : q_rows + (j + 1) * kv_rows] for w in qkv]
            want = full[p + f"self_attn.{name}.weight"]
            if nkv >= tp:
                torch.testing.assert_close(torch.cat(parts), want, rtol=0, atol=0)
            else:  # q head h reads kv head h // (nh // nkv): rank r's q heads read r * nkv // tp
                for r, part in enumerate(parts):
                    first_q_head = r * nh // tp
                    kv_head = first_q_head // (nh // nkv)
                    assert kv_head == r * nkv // tp
                    torch.testing.assert_close(part, want[kv_head * hd : (kv_head + 1) * hd], rtol=0, atol=0)
        torch.testing.assert_close(
            torch.cat([m.layers[i].self_attn.o_proj.weight for m in shards], dim=1), full[p + "self_attn.o_proj.weight"],
            rtol=0, atol=0,
        )
        inter = cfg.intermediate_size // tp
        gate_up = [m.layers[i].mlp.gate_up_proj.weight for m in shards]
        torch.testing.assert_close(torch.cat([w[:inter] for w in gate_up]), full[p + "mlp.gate_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([w[inter:] for w in gate_up]), full[p + "mlp.up_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(
            torch.cat([m.layers[i].mlp.down_proj.weight for m in shards], dim=1), full[p + "mlp.down_proj.weight"],
            rtol=0, atol=0,
        )
        for m in shards:
            torch.testing.assert_close(m.layers[i].input_layernorm.weight, full[p + "input_layernorm.weight"], rtol=0, atol=0)
    embed = torch.cat([m.embed_tokens.weight for m in shards])
    torch.testing.assert_close(embed[:VOCAB], full["model.embed_tokens.weight"], rtol=0, atol=0)
    assert not embed[VOCAB:].any()
    if not tie:
        head = torch.cat([m.lm_head.weight for m in shards])
        torch.testing.assert_close(head[:VOCAB], full["lm_head.weight"], rtol=0, atol=0)
        assert not head[VOCAB:].any()


# --------------------------------------------------------------------------- equivalence


def check_against_tp1(model_dir: Path, world_size: int, tmp_path: Path) -> None:
    single = run_workload(make_runner(str(model_dir)))
    ranks = run_ranks(model_dir, world_size, tmp_path)
    cfg = load_model_config(model_dir)
    assert single["preemptions"] > 0

    # Every rank saw the same step diffs and sampled the same tokens (random ones too).
    for r, result in enumerate(ranks[1:], start=1):
        assert result["digest"] == ranks[0]["digest"], f"rank {r} executed other step diffs than rank 0"
        assert result["tokens"] == ranks[0]["tokens"], f"rank {r} sampled other tokens than rank 0"
    tp_tokens = ranks[0]["tokens"]

    # Greedy: TP equals TP=1 token for token (a difference only at a near tie of HF's logits).
    hf = load_hf_model_from_folder(model_dir)
    refs = hf_greedy(hf, prompts(), NUM_TOKENS, stop_at_eos=False)
    greedy_ids = [f"greedy-{i}" for i in range(len(PROMPT_LENGTHS))]
    assert_greedy_matches([single["tokens"][i] for i in greedy_ids], refs, NUM_TOKENS)
    assert_greedy_matches([tp_tokens[i] for i in greedy_ids], refs, NUM_TOKENS)
    ties = sum(t != s for t, s in zip([tp_tokens[i] for i in greedy_ids], [single["tokens"][i] for i in greedy_ids]))
    assert ties <= 1, "TP and TP=1 greedy outputs differ on more than one prompt"
    # Random sampling (seeded, shared generator, penalties) and logprobs agree with TP=1 too.
    for i in range(len(SAMPLED)):
        assert tp_tokens[f"sampled-{i}"] == single["tokens"][f"sampled-{i}"]
    assert ranks[0]["logprobs"] == single["logprobs"] and len(ranks[0]["logprobs"]["sampled-3"]) == NUM_TOKENS
    # Constrained sampling agrees with TP=1, and follows its regex.
    tokenizer = load_tokenizer(model_dir)
    for i in range(len(CONSTRAINED)):
        tokens = tp_tokens[f"constrained-{i}"]
        assert tokens == single["tokens"][f"constrained-{i}"]
        text = tokenizer.decode([t for t in tokens if t != tokenizer.eos_token_id])
        assert text and re.fullmatch("[a-z ]*", text) and "  " not in text and not text.startswith(" ")

    # Sizes: each rank holds its share of the KV cache (KV heads split or replicated).
    nkv = cfg.num_key_value_heads
    kv_per_rank = nkv // world_size if nkv >= world_size else 1
    for result in ranks:
        assert result["kv_shape"] == [NUM_BLOCKS, CACHE.block_size, kv_per_rank, cfg.head_dim]
        assert result["kv_block_bytes"] * nkv == single["kv_block_bytes"] * kv_per_rank
        assert result["num_params"] < single["num_params"]
        shapes = result["param_shapes"]
        assert shapes["layers.0.mlp.down_proj.weight"] == [cfg.hidden_size, cfg.intermediate_size // world_size]
        assert shapes["embed_tokens.weight"] == [math.ceil(VOCAB / world_size), cfg.hidden_size]


def test_tp2_split_kv_heads_equals_tp1(tmp_path):
    """4 query heads, 2 KV heads on 2 ranks: one KV head per rank."""
    check_against_tp1(tiny_model(tmp_path / "m", 4, 2), 2, tmp_path)


def test_tp4_replicated_kv_heads_equals_tp1(tmp_path):
    """8 query heads, 2 KV heads on 4 ranks: ranks 0-1 keep KV head 0, ranks 2-3 KV head 1."""
    check_against_tp1(tiny_model(tmp_path / "m", 8, 2, tie=True), 4, tmp_path)


# --------------------------------------------------------------------------- other families


FAMILY_PROMPT_LENGTHS = [5, 30, 61, 100]  # past the tiny models' 24-token windows


def family_greedy(runner) -> dict:
    from services.engine import Engine
    from tests.tiny_models import VOCAB as FAMILY_VOCAB

    gen = torch.Generator().manual_seed(5)
    family_prompts = [torch.randint(3, FAMILY_VOCAB, (n,), generator=gen).tolist() for n in FAMILY_PROMPT_LENGTHS]
    engine = Engine(cache_config=CacheConfig(num_gpu_blocks=runner.num_blocks), scheduler_config=SCHED, worker=runner)
    results = engine.generate(family_prompts, GREEDY)
    return {"prompts": family_prompts, "tokens": [r.token_ids for r in results],
            "kv_shape": list(runner.kv_caches[0][0].shape)}


def _family_rank_main(rank: int, world_size: int, init_method: str, model_dir: str, out_dir: str) -> None:
    def compute():
        from services.worker.model_runner import ModelRunner

        runner = ModelRunner(
            ModelRunConfig(model=model_dir, kernel_backend="torch", device="cpu", dtype="float32",
                           quantization="none", seed=7),
            CacheConfig(num_gpu_blocks=128), SCHED, ParallelConfig(world_size, rank, init_method))
        return family_greedy(runner)

    write_rank_result(out_dir, rank, compute)


@pytest.mark.parametrize("arch", ["gemma3", "phi3", "qwen2", "qwen3_moe"])
def test_tp2_model_families_equal_transformers(arch, tmp_path):
    """Gemma 3 (sliding and global KV cache groups), Phi-3 (q/k/v and gate/up cut out of its
    fused checkpoint tensors per rank), Qwen2 (q/k/v biases) and Qwen3-MoE (every expert on
    every rank with its slice of the intermediate size): 4 heads, 2 KV heads on 2 ranks,
    greedy equal to transformers past the sliding window."""
    from tests.tiny_models import make_tiny_model

    folder = make_tiny_model(arch, tmp_path / "m", seed=3)
    ranks = run_ranks(folder, 2, tmp_path, _family_rank_main)
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    assert ranks[0]["kv_shape"][2] == 1  # one of the two KV heads on each rank
    refs = hf_greedy(load_hf_model_from_folder(folder), ranks[0]["prompts"], NUM_TOKENS, stop_at_eos=False)
    assert_greedy_matches(ranks[0]["tokens"], refs, NUM_TOKENS)


# --------------------------------------------------------------------------- batch invariance


def _ordered_sum_rank(rank: int, world_size: int, init_method: str, _model_dir: str, out_dir: str) -> None:
    """Each rank all-reduces the first m rows of its own random matrix, for several m,
    ring and ordered; the digests of row 0..4 of each result."""
    from services.worker.parallel import init_distributed

    def compute():
        tp = init_distributed(ParallelConfig(world_size, rank, init_method), torch.device("cpu"))
        gen = torch.Generator().manual_seed(rank)
        rows = (torch.randn(300, 576, generator=gen) * 10 ** torch.randn(300, 576, generator=gen)).to(torch.bfloat16)
        result = {}
        for name, group in (("ring", tp), ("ordered", __import__("dataclasses").replace(tp, ordered_sums=True))):
            for m in (5, 64, 300):
                summed = group.all_reduce(rows[:m].clone())[:5]
                result[f"{name}{m}"] = hashlib.sha256(summed.view(torch.int16).numpy().tobytes()).hexdigest()
        return result

    write_rank_result(out_dir, rank, compute)


def test_ordered_sums_over_three_ranks_give_a_row_the_same_bits_at_any_row_count(tmp_path):
    results = run_ranks(tmp_path, 3, tmp_path, _ordered_sum_rank)
    assert all(r == results[0] for r in results)  # every rank holds the same sums
    assert results[0]["ordered5"] == results[0]["ordered64"] == results[0]["ordered300"]
